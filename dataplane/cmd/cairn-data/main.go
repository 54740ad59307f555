// Command cairn-data is Cairn's data-plane binary. Each part of the data
// plane is a subcommand; they are added as they are built.
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/cairn-io/cairn/dataplane"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func usage(w io.Writer) {
	fmt.Fprint(w, `usage: cairn-data <command> [flags]

commands:
  version   print the data-plane version
  help      print this message
`)
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "version", "--version":
		fmt.Fprintln(stdout, dataplane.Version)
		return 0
	case "help", "-h", "--help":
		usage(stdout)
		return 0
	default:
		fmt.Fprintf(stderr, "cairn-data: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
}
