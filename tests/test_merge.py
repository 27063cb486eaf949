"""tpsample.merge in plain torch: the rules every stage 2 implements (tie breaks, the
degenerate-row rule, the inverse-CDF edge cases, the binary merge)."""
import torch

from tpsample import merge
from tpsample.records import NO_TOKEN


def test_pathwise_max_breaks_ties_by_the_smaller_token():
    score = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    token = torch.tensor([[5.0, 9.0, 4.0, 1.0]])
    assert merge.pathwise_max(score, token).item() == 2
    assert merge.pathwise_max(torch.full((1, 3), float("-inf")), torch.tensor([[7.0, 2.0, NO_TOKEN]])).item() == 1


def test_inverse_cdf_edges():
    w = torch.tensor([[0.0, 1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    u = torch.tensor([0.2, 0.5, 0.999999])
    assert merge.inverse_cdf(w, u).tolist() == [1, 0, 0]  # first crossing; nothing positive: 0
    assert merge.inverse_cdf(w[:1], torch.tensor([0.25])).item() == 3  # 0.25 * 4 = 1: not above 1
    assert merge.inverse_cdf(w[:1], torch.tensor([1.0])).item() == 3  # rounding past the end: last positive


def test_binary_merge_probabilities_and_empty_state():
    a, b = torch.tensor([0.0, float("-inf"), 0.0]), torch.tensor([0.0, 1.0, float("-inf")])
    take, merged = merge.binary_merge(a, b, torch.tensor([0.49, 0.99, 0.0001]))
    assert take.tolist() == [True, True, False]
    assert torch.allclose(merged, torch.tensor([0.6931472, 1.0, 0.0]))


def test_finish_marks_degenerate_rows():
    token = torch.tensor([[3.0], [4.0], [5.0]])
    logit = torch.tensor([[1.0], [2.0], [3.0]])
    logz = torch.tensor([2.0, float("nan"), float("-inf")])
    tokens, logprobs = merge.finish(token, logit, logz)
    assert tokens.tolist() == [[3], [-1], [-1]] and logprobs[0, 0] == -1.0
    assert torch.isnan(logprobs[1:]).all() and tokens.dtype == torch.int64


def test_reduce_records_group_merges_take_the_chosen_groups_winner():
    """Two groups with all the mass in group 1: every merge returns group 1's token;
    greedy rows take the pathwise winner even under a group merge."""
    rec = torch.tensor([[[[[5.0, 10.0, -50.0, -50.0], [1.0, 200.0, 0.0, 0.0]]]]])  # [1, 1, 1, 2, 4]
    seed, offset = torch.tensor([1]), torch.tensor([0])
    for m in ("logmass", "cdf"):
        tokens, _, logz = merge.reduce_records(rec, seed, offset, torch.tensor([False]), m)
        assert tokens.item() == 200 and abs(logz.item()) < 1e-6
        greedy, _, _ = merge.reduce_records(rec, seed, offset, torch.tensor([True]), m)
        assert greedy.item() == 10
    assert merge.reduce_records(rec, seed, offset, torch.tensor([False]), "max")[0].item() == 10
