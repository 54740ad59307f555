// Package dataplane is the root of Cairn's data plane: the dataconn wire
// protocol, the replica server, the engine and its frontends, and the
// instance manager. It is a module of its own and never imports the
// operator (the root module).
package dataplane

// Version is the data-plane version, overridden at link time with
// -ldflags "-X github.com/cairn-io/cairn/dataplane.Version=...".
var Version = "dev"
