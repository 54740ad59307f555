package chaos

import (
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// BlockSize is the unit the workload reads and writes.
const BlockSize = 4096

// Values: 0 is "zeros" (never written, or trimmed); a write's value is
// client<<32 | sequence, unique in the schedule; corrupt marks a block
// whose bytes match no write at all.
const corrupt = math.MaxUint64

// encode makes the 4 KiB a write of value v to block b carries: a header
// naming block and value, then bytes derived from both, so a torn or
// misplaced block decodes to corrupt.
func encode(b int, v uint64) []byte {
	p := make([]byte, BlockSize)
	if v == 0 {
		return p
	}
	copy(p, "CHAOSv1\x00")
	binary.LittleEndian.PutUint64(p[8:], uint64(b))
	binary.LittleEndian.PutUint64(p[16:], v)
	x := v*0x9e3779b97f4a7c15 ^ uint64(b)
	for i := 24; i < len(p); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(p[i:], x)
	}
	return p
}

func decode(b int, p []byte) uint64 {
	allZero := true
	for _, c := range p {
		if c != 0 {
			allZero = false
			break
		}
	}
	if allZero {
		return 0
	}
	if string(p[:8]) != "CHAOSv1\x00" || binary.LittleEndian.Uint64(p[8:]) != uint64(b) {
		return corrupt
	}
	v := binary.LittleEndian.Uint64(p[16:])
	if string(encode(b, v)) != string(p) {
		return corrupt
	}
	return v
}

type opKind uint8

const (
	opRead opKind = iota
	opWrite
)

type input struct {
	kind  opKind
	block int
	value uint64 // for writes (0 = trim)
}

type output struct{ value uint64 } // for reads

// history records operations from every client.
type history struct {
	mu    sync.Mutex
	start time.Time
	ops   []porcupine.Operation
}

func newHistory() *history { return &history{start: time.Now()} }

func (h *history) now() int64 { return int64(time.Since(h.start)) }

// forever is the completion time of an operation whose outcome is unknown:
// it may take effect at any point after it was invoked.
const forever = math.MaxInt64 / 2

func (h *history) add(client int, in input, out output, call, ret int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ops = append(h.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
}

func (h *history) len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.ops)
}

// registerModel is a register per block: a read returns the last value
// written (0 before any write, and after a trim).
var registerModel = porcupine.Model{
	Partition: func(ops []porcupine.Operation) [][]porcupine.Operation {
		by := map[int][]porcupine.Operation{}
		var order []int
		for _, op := range ops {
			b := op.Input.(input).block
			if _, ok := by[b]; !ok {
				order = append(order, b)
			}
			by[b] = append(by[b], op)
		}
		out := make([][]porcupine.Operation, 0, len(by))
		for _, b := range order {
			out = append(out, by[b])
		}
		return out
	},
	Init: func() interface{} { return uint64(0) },
	Step: func(state, in, out interface{}) (bool, interface{}) {
		i := in.(input)
		if i.kind == opWrite {
			return true, i.value
		}
		return out.(output).value == state.(uint64), state
	},
	DescribeOperation: func(in, out interface{}) string {
		i := in.(input)
		if i.kind == opWrite {
			if i.value == 0 {
				return fmt.Sprintf("trim(b%d)", i.block)
			}
			return fmt.Sprintf("write(b%d, %s)", i.block, valueName(i.value))
		}
		return fmt.Sprintf("read(b%d) -> %s", i.block, valueName(out.(output).value))
	},
	DescribeState: func(s interface{}) string { return valueName(s.(uint64)) },
}

func valueName(v uint64) string {
	switch v {
	case 0:
		return "zeros"
	case corrupt:
		return "CORRUPT"
	}
	return fmt.Sprintf("c%d#%d", v>>32, v&0xffffffff)
}

// check runs porcupine over the history. ok is false for a violation;
// info is for the visualisation.
func (h *history) check(timeout time.Duration) (porcupine.CheckResult, porcupine.LinearizationInfo) {
	h.mu.Lock()
	ops := append([]porcupine.Operation(nil), h.ops...)
	h.mu.Unlock()
	return porcupine.CheckOperationsVerbose(registerModel, ops, timeout)
}

// explain finds the blocks whose histories are not linearizable and, for
// the first, the shortest prefix (by invocation) that is not, and returns
// its last operations: the minimal history around the violation.
func (h *history) explain() string {
	h.mu.Lock()
	ops := append([]porcupine.Operation(nil), h.ops...)
	h.mu.Unlock()
	for _, part := range registerModel.Partition(ops) {
		if porcupine.CheckOperations(registerModel, part) {
			continue
		}
		sort.Slice(part, func(i, j int) bool { return part[i].Call < part[j].Call })
		lo, hi := 1, len(part) // the shortest failing prefix is in (lo-1, hi]
		for lo < hi {
			mid := (lo + hi) / 2
			if porcupine.CheckOperations(registerModel, part[:mid]) {
				lo = mid + 1
			} else {
				hi = mid
			}
		}
		prefix := part[:hi]
		from := max(0, len(prefix)-20)
		var b strings.Builder
		fmt.Fprintf(&b, "block %d: the first %d operations on it are not linearizable; the last %d:\n",
			prefix[0].Input.(input).block, len(prefix), len(prefix)-from)
		for _, op := range prefix[from:] {
			ret := "never returned (outcome unknown)"
			if op.Return < forever {
				ret = fmt.Sprintf("returned %.6fs", float64(op.Return)/1e9)
			}
			fmt.Fprintf(&b, "    client %d  invoked %.6fs  %s  %s\n", op.ClientId, float64(op.Call)/1e9,
				registerModel.DescribeOperation(op.Input, op.Output), ret)
		}
		return b.String()
	}
	return ""
}
