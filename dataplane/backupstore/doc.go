// Package backupstore writes volume backups to a backup target (an
// S3-compatible bucket or a filesystem directory such as a mounted NFS
// export) and reads them back.
//
// A backup is a manifest that lists, for every block of the volume that is
// not all zeros, the SHA-256 of the block's bytes. Blocks are stored once
// per volume under that hash (content addressing), compressed with S2, so a
// backup shares every unchanged block with the earlier backups of the same
// volume. The bytes hashed and stored are the bytes the caller gives: an
// encrypted volume's blocks are ciphertext, and the store never sees
// plaintext.
//
// Order of writes: blocks, then the manifest (the commit point: a backup
// without its manifest does not exist for readers), then the per-volume
// index that lists backups (a cache of the manifests, rebuildable from
// them). Deleting a backup deletes its manifest; blocks no manifest
// references are removed by CollectGarbage, which never runs while a
// backup or restore of the volume holds a live lease on the target.
//
// Everything read from a target is decoded with bounds: a corrupt or
// hostile target cannot make the reader allocate more than the object
// sizes the volume's size and block size imply. Every call to a target is
// bounded by a timeout and transient failures are retried with back-off.
//
// docs/backup.md describes the format on the target and the guarantees.
package backupstore
