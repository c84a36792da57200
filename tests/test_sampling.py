"""The host sampler's arithmetic without a model: a token's logprob and its alternatives."""

import numpy as np

from engine.sampling import token_logprobs


def test_token_logprobs_are_a_log_softmax_with_the_top_alternatives():
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(5000) * 4).astype(np.float32)
    ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    lp, top = token_logprobs(row, 17, 5)
    assert abs(lp - ref[17]) < 1e-4
    assert [t for t, _ in top] == list(np.argsort(ref)[::-1][:5])
    assert all(abs(v - ref[t]) < 1e-4 for t, v in top)
    assert token_logprobs(row, 3, 0)[1] == []
