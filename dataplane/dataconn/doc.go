// Package dataconn is Cairn's data-plane wire protocol between the engine and
// its replicas: a versioned, checksummed, pipelined request/response framing
// over any byte stream (TCP or a unix socket), and the client and server that
// speak it.
//
// Every frame is a fixed 48-byte header followed by PayloadLen bytes:
//
//	off size field
//	  0   4  magic       "CRND" (0x43 0x52 0x4e 0x44)
//	  4   1  version     1
//	  5   1  op          request op, or request op | 0x80 for its reply
//	  6   1  flags       FlagFUA, FlagShared (writes only); unknown bits are rejected
//	  7   1  code        error code of a reply; 0 = ok; always 0 in requests
//	  8   8  seq         request sequence number, echoed in the reply
//	 16   8  offset      byte offset on the volume
//	 24   8  epoch       replica-set generation the sender believes current
//	 32   4  length      bytes to read, write or unmap
//	 36   4  payloadLen  bytes following the header
//	 40   4  payloadCRC  CRC32C (Castagnoli) of the payload
//	 44   4  headerCRC   CRC32C of header bytes 0..43
//
// All integers are big-endian. docs/dataconn.md describes the ops, the error
// codes and the versioning rule.
//
// The package has two layers. The framing (protocol.go) does no I/O policy:
// PutHeader and ParseHeader write and check a header in a caller's buffer;
// Encode, Decode, ReadFrame and AppendFrame add the payload. Decoding rejects
// a bad magic, version or checksum, an unknown op or flag and an oversize
// payload before allocating it.
//
// Client and Server are the transport on top of the framing, with the I/O
// policy of their own. They frame with PutHeader and ParseHeader into
// buffers they reuse, read many frames per system call (internal/bufread)
// and write the frames queued meanwhile with one writev (internal/batchwrite).
// The client spreads requests over several connections, matches replies to
// requests by sequence number, bounds each request with a timeout and pings
// every connection; a failed connection fails the client. The server runs
// requests on a bounded pool of workers, so replies may come out of order,
// and checks each request's range and the sender's epoch (EpochBackend)
// before it touches the backend. Both optionally run the key handshake
// (auth.go) and TLS, and on a unix connection the client may attach shared
// memory (OpAttach) so that writes carry an offset into it (FlagShared)
// instead of their data. Acceptor keeps a serve loop going through
// transient accept failures with a back-off.
package dataconn
