"""The shared weight-equality rule (tests/equality.py) on Adam runs simulated in numpy: float32
noise in a near-zero gradient passes, a wrong gradient on one entry fails. Milliseconds."""
import numpy as np
import pytest

from equality import GRADIENT_ATOL, assert_weights_equal, entry_tolerance

LEARNING_RATES = [1.5e-3, 3e-3, 3e-3, 2e-3]  # warmup 2 then decay, as the tests' runs
NOISE_ENTRY, CLEAR_ENTRY, LATE_ENTRY = 7, 100, 200


def adam(w, gradients, learning_rates, beta_1=0.9, beta_2=0.95, eps=1e-8):
    """Keras' bias-corrected Adam, update by update (no weight decay)."""
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, (g, lr) in enumerate(zip(gradients, learning_rates), start=1):
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g * g
        w = w - lr * (m / (1 - beta_1 ** t)) / (np.sqrt(v / (1 - beta_2 ** t)) + eps)
    return w


@pytest.fixture
def runs():
    """(initial weights, the reference's gradients per update, another layout's: the same plus
    float32-sized noise, which flips the sign of the one entry whose gradient is zero)."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, 1024)
    reference = [rng.normal(0, 1e-2, 1024) for _ in LEARNING_RATES]
    for g in reference:
        g[NOISE_ENTRY] = 5e-8  # zero in exact arithmetic (e.g. a key bias under softmax)
    reference[0][LATE_ENTRY] = 0.0  # e.g. a token absent from the first batch: exactly zero
    other = [g + rng.uniform(-0.5, 0.5, g.shape) * GRADIENT_ATOL for g in reference]
    for g in other:
        g[NOISE_ENTRY] = -5e-8
    other[0][LATE_ENTRY] = 0.0  # an exact zero is zero in every summation order
    return w, reference, other


def test_float32_noise_in_a_near_zero_gradient_passes_where_a_flat_atol_fails(runs):
    w, reference, other = runs
    theirs, ours = adam(w, reference, LEARNING_RATES), adam(w, other, LEARNING_RATES)
    gap = abs(ours[NOISE_ENTRY] - theirs[NOISE_ENTRY])
    assert gap > sum(LEARNING_RATES)  # Adam moved it the other way every update (eps damps it)
    assert not np.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert_weights_equal([ours], [theirs], [[g] for g in reference], LEARNING_RATES)
    with pytest.raises(AssertionError, match="flat tolerance"):  # LAMB: no Adam allowance
        assert_weights_equal([ours], [theirs], [], [])
    # and every other entry still within the tight tolerance
    assert np.allclose(np.delete(ours, NOISE_ENTRY), np.delete(theirs, NOISE_ENTRY),
                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bug", ["sign", "one_update_doubled", "offset", "late_sign"])
def test_a_wrong_gradient_on_one_entry_fails(runs, bug):
    w, reference, other = runs
    wrong = [g.copy() for g in other]
    if bug == "sign":
        for g in wrong:
            g[CLEAR_ENTRY] = -g[CLEAR_ENTRY]
    elif bug == "one_update_doubled":
        wrong[1][CLEAR_ENTRY] *= 2
    elif bug == "offset":  # a gradient off by 1% of the tensor's scale, every update
        for g in wrong:
            g[CLEAR_ENTRY] += 1e-4
    else:  # an entry whose first gradient is zero, wrong after: later gradients hold it tight
        for g in wrong[1:]:
            g[LATE_ENTRY] = -g[LATE_ENTRY]
    theirs, ours = adam(w, reference, LEARNING_RATES), adam(w, wrong, LEARNING_RATES)
    entry = LATE_ENTRY if bug == "late_sign" else CLEAR_ENTRY
    with pytest.raises(AssertionError, match=rf"1 of 1024 entries .* worst at \({entry},\)"):
        assert_weights_equal([ours], [theirs], [[g] for g in reference], LEARNING_RATES,
                             names=["block_1/mlp/fc/kernel"])


def test_the_allowance_is_tight_for_clear_gradients_and_2_lr_per_update_for_zero_ones():
    weights = np.zeros(3)
    allowed = entry_tolerance(weights, [np.array([0.0, 1e-6, 1e-2])], LEARNING_RATES)
    assert allowed[0] == pytest.approx(1e-6 + 2 * sum(LEARNING_RATES), rel=0.01)
    assert allowed[2] < 2e-6  # a clear gradient: the weight's rounding + 5e-7 of gradient noise
    assert allowed[2] < allowed[1] < allowed[0]


def test_the_first_update_s_gradients_alone_suffice_for_the_noise_case(runs):
    """test_cross_rank records the first batch's gradients only: still passes the noise."""
    w, reference, other = runs
    theirs, ours = adam(w, reference, LEARNING_RATES), adam(w, other, LEARNING_RATES)
    assert_weights_equal([ours], [theirs], [[reference[0]]], LEARNING_RATES)
