"""Timing helpers shared by the peer scripts (they import this file from their own folder)."""
import triton.testing as tt


def ms(fn):
    """Median milliseconds per call of `fn` (triton's do_bench: warm-up, then repeated calls)."""
    return tt.do_bench(fn, warmup=25, rep=200, return_mode="median")


def fwd_bwd(fn, inputs, dy):
    """A callable that runs `fn()` forward and its backward against `dy`, clearing the grads of
    `inputs` first."""
    def run():
        for t in inputs:
            t.grad = None
        fn().backward(dy)
    return run
