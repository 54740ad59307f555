// Package nbd serves a block device over the NBD protocol (fixed newstyle
// handshake, simple replies) on any listener: a unix socket for local
// clients such as qemu-io, nbdinfo, fio's nbd engine or the kernel's nbd
// driver.
package nbd

// Protocol constants, from the NBD protocol specification.
const (
	magicNBD       = 0x4e42444d41474943 // "NBDMAGIC"
	magicOpt       = 0x49484156454f5054 // "IHAVEOPT"
	magicOptReply  = 0x0003e889045565a9
	magicRequest   = 0x25609513
	magicSimpleRep = 0x67446698

	// Handshake flags (server) and client flags.
	flagFixedNewstyle = 1 << 0
	flagNoZeroes      = 1 << 1
	clientFixed       = 1 << 0
	clientNoZeroes    = 1 << 1

	// Options.
	optExportName       = 1
	optAbort            = 2
	optList             = 3
	optInfo             = 6
	optGo               = 7
	optStructuredReply  = 8
	repAck              = 1
	repServer           = 2
	repInfo             = 3
	repErrUnsup         = 1<<31 | 1
	repErrInvalid       = 1<<31 | 3
	repErrUnknown       = 1<<31 | 6
	infoExport          = 0
	infoBlockSize       = 3
	maxOptionLength     = 64 << 10
	transmissionHasFlag = 1 << 0

	// Transmission flags.
	tflagSendFlush        = 1 << 2
	tflagSendFUA          = 1 << 3
	tflagSendTrim         = 1 << 5
	tflagSendWriteZeroes  = 1 << 6
	tflagCanMultiConn     = 1 << 8
	transmissionFlagsBase = transmissionHasFlag | tflagSendFlush | tflagSendFUA | tflagSendTrim | tflagSendWriteZeroes | tflagCanMultiConn

	// Commands and their flags.
	cmdRead        = 0
	cmdWrite       = 1
	cmdDisc        = 2
	cmdFlush       = 3
	cmdTrim        = 4
	cmdWriteZeroes = 6
	cmdFlagFUA     = 1 << 0
	cmdFlagNoHole  = 1 << 1

	// Error values (errno numbers, as the protocol defines them).
	errIO       = 5
	errInval    = 22
	errNoSpc    = 28
	errOverflow = 75
	errShutdown = 108
)

// MaxRequest is the largest read or write accepted (32 MiB, as the
// protocol recommends clients stay within).
const MaxRequest = 32 << 20
