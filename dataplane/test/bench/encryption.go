package main

import (
	"crypto/rand"
	"flag"
	"os"
	"strings"

	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// The encryption table: 4 KiB random I/O on three replicas, the volume
// encrypted at rest (cairn-3-enc) against the same volume unencrypted
// (cairn-3), measured in the same rounds, with their ratio (enc/c3) and
// the CPU time per I/O that tells where a gap comes from.

var encTable = flag.Bool("encryption", true, "also a table of 4 KiB random I/O with three replicas, encrypted at rest (cairn-3-enc) against unencrypted (cairn-3), buffered I/O")

// encrypted is cairn-3 with the volume encrypted by a random key, given
// to the engine as the instance manager does: through a pipe.
func encrypted(work string) target {
	return cairnWith(work, "cairn-3-enc", 3, 1, func() ([]string, []*os.File) {
		key := make([]byte, volcrypt.KeySize)
		rand.Read(key)
		return []string{"--encryption-key-fd", "3", "--encryption-key-check", volcrypt.KeyCheck(key)}, []*os.File{keyPipe(key)}
	}, nil)
}

// keyPipe is the read end of a pipe holding key, as the instance manager
// hands a process its keys (the child's descriptor 3).
func keyPipe(key []byte) *os.File {
	r, w, err := os.Pipe()
	must(err)
	_, err = w.Write(key)
	must(err)
	must(w.Close())
	return r
}

// encryptionTable measures cairn-3 and cairn-3-enc on the 4 KiB workloads
// with buffered I/O.
func encryptionTable(work string, targets map[string]func(string) target) {
	saved, savedDirect := workloads, direct
	defer func() { workloads, direct = saved, savedDirect }()
	workloads, direct = nil, false
	for _, w := range saved {
		if strings.HasPrefix(w.name, "4k ") && !strings.Contains(w.name, "QD16") { // QD32 and QD1 say it
			workloads = append(workloads, w)
		}
	}
	if len(workloads) == 0 {
		return // --workloads left none of them
	}
	table(work, "encryption at rest, buffered", []string{"cairn-3", "cairn-3-enc"}, targets)
}
