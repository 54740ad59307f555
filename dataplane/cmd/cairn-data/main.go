// Command cairn-data is Cairn's data-plane binary. Each part of the data
// plane is a subcommand.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/cairn-io/cairn/dataplane"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	// CAIRN_CPUPROFILE=PREFIX writes a CPU profile to PREFIX.<pid> (for
	// developers measuring the data path).
	if prefix := os.Getenv("CAIRN_CPUPROFILE"); prefix != "" {
		if f, err := os.Create(fmt.Sprintf("%s.%d", prefix, os.Getpid())); err == nil {
			if err := pprof.StartCPUProfile(f); err != nil {
				fmt.Fprintf(os.Stderr, "CAIRN_CPUPROFILE: %v\n", err)
			}
			defer pprof.StopCPUProfile()
		}
	}
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	pprof.StopCPUProfile()
	os.Exit(code)
}

func usage(w io.Writer) {
	fmt.Fprint(w, `usage: cairn-data <command> [flags]

commands:
  replica   serve one replica directory over dataconn (data) and gRPC (control)
  engine    serve a volume from its replicas through a frontend (nbd, fuse)
  ctl       talk to an engine's control API (replicas, rebuilds, snapshots)
  instance-manager
            supervise this node's engine and replica processes for the manager (gRPC)
  device-keeper
            hold the fuse frontends' devices while their engines restart
  backup    back a replica's snapshot up to a directory or S3 target (incremental with a base)
  restore   write a backup from a target to a new file or a block device
  version   print the data-plane version
  help      print this message

Run 'cairn-data <command> -h' for a command's flags.
`)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "replica":
		return runReplica(ctx, args[1:], stdout, stderr)
	case "engine":
		return runEngine(ctx, args[1:], stdout, stderr)
	case "ctl":
		return runCtl(ctx, args[1:], stdout, stderr)
	case "instance-manager":
		return runInstanceManager(ctx, args[1:], stdout, stderr)
	case "device-keeper":
		return runDeviceKeeper(ctx, args[1:], stdout, stderr)
	case "backup":
		return runBackup(ctx, args[1:], stdout, stderr)
	case "restore":
		return runRestore(ctx, args[1:], stdout, stderr)
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
