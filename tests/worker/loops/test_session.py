from worker.loops.session import micro_batches


def test_micro_batches_group_shortest_first_within_the_token_budget():
    lengths = [7, 3, 12, 5, 3, 40]
    groups = micro_batches(lengths, max_tokens=16)
    # 3, 3, 5 pad to 5 (15 tokens); 7 and 12 pad to 12 (24 > 16) so split; 40 exceeds the budget alone
    assert groups == [[1, 4, 3], [0], [2], [5]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert micro_batches([4] * 8, max_tokens=16) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert micro_batches([], max_tokens=16) == []
