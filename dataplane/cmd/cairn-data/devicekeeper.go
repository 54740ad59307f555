package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/cairn-io/cairn/dataplane/devicekeeper"
)

// runDeviceKeeper holds the FUSE frontends' devices of this node's
// volumes while their engines restart (package devicekeeper). It runs
// outside the instance manager's pod, whose deletion it must outlive.
func runDeviceKeeper(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cairn-data device-keeper", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", devicekeeper.DefaultSocket, "unix socket the engines reach the keeper on (their --device-keeper); its directory is made with mode 0700")
	holdFor := fs.Duration("hold-for", devicekeeper.DefaultHoldFor, "how long a device whose engine went is held for the next engine of the volume; then the keeper lets go of it and the I/O waiting on it fails")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cairn-data device-keeper [--socket PATH] [--hold-for DURATION]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "cairn-data device-keeper: "+format+"\n", a...)
		return 1
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return 2
	}
	if !filepath.IsAbs(*socket) || len(*socket) > 107 {
		return fail("--socket %q: give an absolute path of at most 107 bytes", *socket)
	}
	if *holdFor < time.Second {
		return fail("--hold-for %v: give at least 1s", *holdFor)
	}
	lock, err := devicekeeper.Lock(*socket)
	if err != nil {
		return fail("%v", err)
	}
	defer lock.Close()
	l, err := devicekeeper.Listen(*socket)
	if err != nil {
		return fail("%v", err)
	}
	log := newLogger(stderr, "device-keeper")
	k := devicekeeper.New(devicekeeper.Options{HoldFor: *holdFor, Logger: log})
	fmt.Fprintf(stdout, "ready socket=%s\n", *socket)
	err = k.Serve(ctx, l)
	// Exiting closes every descriptor held: a device whose engine runs
	// goes on (the engine deposits it again with the next keeper); one
	// whose engine is gone too fails its waiting I/O.
	if held := k.Held(); len(held) > 0 {
		log.Info("stopping; the engines that run deposit their devices again with the next keeper", "held", len(held))
	}
	k.Close()
	if err != nil {
		return fail("%v", err)
	}
	return 0
}
