package replicaserver

// FlushClean serves a clean flush (dataconn.FlagClean): see
// replica.Replica.FlushClean.
func (b Backend) FlushClean() error { return wire(b.Replica.FlushClean()) }

// FlushCleanEpoch is FlushClean for a request of the given epoch.
func (b Backend) FlushCleanEpoch(e uint64) error { return wire(b.Replica.FlushCleanEpoch(e)) }
