//go:build !cairn_unsafe

package engine

import "context"

// unsafeAckEarlyBuilt: this build lacks the broken write path of
// Options.UnsafeAckEarly (unsafe_ackearly.go, -tags cairn_unsafe); Open
// refuses the option with ErrUnsafeNotBuilt.
const unsafeAckEarlyBuilt = false

// mutateEarly is never called in this build (its one call is behind
// unsafeAckEarlyBuilt), so the compiler drops the call and the linker this
// stub: the binary holds no broken write path.
func (e *Engine) mutateEarly(context.Context, *lockedRange, []*member, []Mode, func(*member) error) error {
	panic("engine: the UnsafeAckEarly write path is not built in (needs -tags cairn_unsafe)")
}
