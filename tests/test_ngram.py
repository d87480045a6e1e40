"""N-gram prompt lookup: the reference `propose` on hand-made sequences, and `NgramIndex` against it."""
import random

import pytest

from tp_engine.speculative.ngram import NgramIndex, propose


def test_repetition_proposes_what_followed():
    """A repeated phrase proposes the tokens that followed its earlier occurrence."""
    assert propose([1, 2, 3, 4, 1, 2, 3], k=3) == [4, 1, 2]
    assert propose([1, 2, 3, 4, 1, 2, 3], k=1) == [4]


def test_longest_recurring_ngram_wins_and_n_max_bounds_it():
    """The longest recurring suffix (up to n_max) wins over a more recent match of a shorter one."""
    tokens = [1, 2, 3, 9, 5, 3, 7, 2, 3]  # "2 3" recurs at 1 (then 9); "3" most recently at 5 (then 7)
    assert propose(tokens, k=3) == [9, 5, 3]
    assert propose(tokens, k=3, n_max=2) == [9, 5, 3]
    assert propose(tokens, k=3, n_max=1) == [7, 2, 3]


def test_n_min_bounds_the_shortest_match():
    """With n_min 2, a suffix whose only recurring n-gram is one token proposes nothing."""
    tokens = [5, 1, 6, 2, 8, 1]  # only "1" recurs
    assert propose(tokens, k=2) == [6, 2]
    assert propose(tokens, k=2, n_min=2) == []


def test_nothing_recurring_proposes_nothing():
    assert propose([1, 2, 3, 4, 5], k=4) == []
    assert propose([], k=4) == []
    assert propose([7], k=4) == []


def test_k_larger_than_what_follows():
    """Near the end fewer than k tokens follow the occurrence: those are proposed."""
    assert propose([5, 6, 7, 5], k=10) == [6, 7, 5]
    assert propose([5, 6, 7, 5], k=0) == []


def test_most_recent_earlier_occurrence_wins():
    tokens = [1, 2, 8, 1, 2, 9, 1, 2]  # "1 2" at 0 (then 8) and at 3 (then 9)
    assert propose(tokens, k=3) == [9, 1, 2]


def test_occurrence_may_not_overlap_the_suffix():
    """In a run of one token, the 4-gram at 0 overlaps the suffix (starting at 1) and is not used: the
    longest usable match is the 2-gram at 1, which leaves two tokens to propose."""
    assert propose([7] * 5, k=4) == [7, 7]
    assert propose([7] * 8, k=4) == [7, 7, 7, 7]
    assert propose([1, 2, 1, 2, 1], k=4) == [2, 1]  # "1 2 1" at 0 overlaps; "2 1" at 1 does not


def test_window_limits_where_occurrences_may_start():
    """Only occurrences that start within the last `window` tokens count; a longer n-gram outside it gives
    way to a shorter one inside."""
    tokens = [4, 5, 6, 7, 5, 8, 4, 5]  # "4 5" at 0 (then 6); "5" most recently at 4 (then 8)
    assert propose(tokens, k=3, window=8) == [6, 7, 5]
    assert propose(tokens, k=3, window=7) == [8, 4, 5]
    assert propose(tokens, k=3, window=3) == []


@pytest.mark.parametrize("kwargs, word", [({"k": -1}, "k"), ({"k": 2, "n_min": 0}, "n_min"),
                                          ({"k": 2, "n_min": 3, "n_max": 2}, "n_max"),
                                          ({"k": 2, "window": 0}, "window")])
def test_bad_arguments_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        propose([1, 2, 1], **kwargs)
    with pytest.raises(ValueError, match=word):
        NgramIndex(**{key: v for key, v in kwargs.items() if key != "k"}).propose(kwargs["k"])


@pytest.mark.parametrize("n_max, n_min, window", [(4, 1, None), (3, 2, None), (1, 1, None), (4, 1, 12),
                                                  (5, 3, 30)])
def test_index_equals_the_reference_after_every_append(n_max, n_min, window):
    """Fed random tokens of a small alphabet (many recurring n-grams, runs, overlaps) one at a time or in
    chunks, the index proposes what the reference does at every length and for several k."""
    rng = random.Random(n_max * 100 + n_min * 10 + (window or 0))
    for trial in range(20):
        alphabet = rng.choice([2, 3, 5])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(60))]
        index = NgramIndex(n_max=n_max, n_min=n_min, window=window)
        size = 0
        while size < len(tokens):
            step = 1 if trial % 2 else rng.randrange(1, 6)
            index.extend(tokens[size:size + step])
            size = min(len(tokens), size + step)
            assert len(index) == size
            for k in (0, 1, 3, 8):
                want = propose(tokens[:size], k, n_max=n_max, n_min=n_min, window=window)
                assert index.propose(k) == want, (tokens[:size], k)


def test_index_starts_from_given_tokens():
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert NgramIndex(tokens).propose(3) == propose(tokens, 3) == [4, 1, 2]
