"""How close two engines' outputs must be: a bound from the engine dtype's precision.

The engine tests compare what an engine produces after loading KV from the store with what a
fresh prefill (or another engine) produces for the same prompt. The two runs do the same
arithmetic in a different order: a prefill of the whole prompt against attention over loaded
blocks plus a short chunk, batches of other shapes, and — on CPUs with AMX — oneDNN kernels that
block a matrix product differently for a different number of rows. Every such order is correct;
they round differently. So the bound must follow from the dtype, not from the kernels one CPU
happens to pick.

In bfloat16 (the tiny models' native dtype) that bound is useless: bf16 keeps 8 significant bits
(unit roundoff 2**-8), the logits a logprob comes from are bf16 numbers, and a logprob near
-ln(1024) = -6.9 has a spacing of 2**-5 there. The same store-load comparisons in bf16 were
0.0019 apart on a machine whose CPU has AMX (the old `abs=1e-3` failed there) and at most 3e-5
apart on one without AMX: the kernels decided, not the connector.

So every engine the tests start runs in float32 (`TEST_ENGINE_DTYPE`, applied by the engine
fixtures in `tests/fixtures/vllm.py`), and the bound is the standard worst-case forward error of
one float32 reduction of length n, gamma_n ~ n * u (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., section 3.1), taken relative to the logprob's magnitude, with n the
longest reduction a logprob passes through in the tiny models: the log-softmax over the
1,024-entry vocabulary (the hidden and MLP sizes, 64 and 128, are shorter). That is about 6e-5
relative, 4e-4 at a logprob of -6.5: far above what reordering float32 sums does (the
selective, live-settings, hybrid and connector engine tests differed by at most 4.8e-7, one
float32 spacing at 6.5, on a machine without AMX; gamma_n bounds a reduction summed in any
order, so it does not depend on the kernel), and five times tighter than the bf16 differences an
AMX machine produced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The dtype every test engine runs in (see the module docstring).
TEST_ENGINE_DTYPE = "float32"
#: The longest reduction behind a logprob in the test models: the log-softmax over the vocabulary.
LONGEST_REDUCTION = 1024


def logprob_tolerance(dtype: str = TEST_ENGINE_DTYPE, reduction: int = LONGEST_REDUCTION) -> float:
    """Relative bound on a logprob's difference between two correct runs: gamma_n = n * u."""
    unit_roundoff = torch.finfo(getattr(torch, dtype)).eps / 2
    return reduction * unit_roundoff


def assert_same_logprobs(mine: Sequence[float] | None, reference: Sequence[float] | None,
                         *context: object) -> None:
    """Per generated token, the chosen token's logprob within `logprob_tolerance` of the reference."""
    assert mine is not None and reference is not None, ("no logprobs asked for", *context)
    assert len(mine) == len(reference), (len(mine), len(reference), *context)
    relative = logprob_tolerance()
    for step, (a, b) in enumerate(zip(mine, reference, strict=True)):
        bound = relative * max(1.0, abs(b))
        assert abs(a - b) <= bound, (f"token {step}: logprob {a} vs {b} (|diff| {abs(a - b):.3g} > "
                                     f"{bound:.3g}, the {TEST_ENGINE_DTYPE} bound)", *context)
