"""Model FLOPs from a decoder's shapes: hand-computed on a one-layer shape, and the projections and
head against torch's own FLOP counter on a real (tiny) Llama."""

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from worker.algos import flops

# one layer, hidden 2, a gated MLP of 3, one head of 2, vocabulary 5
S = flops.DecoderShape(layers=1, hidden=2, intermediate=3, heads=1, kv_heads=1, head_dim=2, vocab=5)


def test_a_tokens_projections_head_and_attention_by_hand():
    assert S.linear_per_token() == 2 * (2 * 2 * 2 + 2 * 2 * 2 + 3 * 2 * 3)  # q, o; k, v; gate, up, down = 68
    assert S.head_per_token() == 2 * 2 * 5
    assert S.attention(3, 0) == 4 * 1 * 2 * (1 + 2 + 3)  # causal: position i attends to i keys
    assert S.attention(1, 4) == 4 * 1 * 2 * 5  # one new token against 4 cached and itself


def test_a_forward_and_sampling_count_the_same_positions():
    assert flops.forward(S, 2, 1) == 3 * 68 + 48 + 1 * 20
    assert flops.prefill(S, 2) == 2 * 68 + 24 + 20  # its logits give the first sampled token
    assert flops.decode(S, 2, 3) == 2 * (68 + 20) + 24 + 32  # tokens 2 and 3 against 2+1 and 2+2 keys
    # sampling c tokens computes every position a teacher-forced forward does but the last one's
    for p, c in [(2, 3), (5, 1), (7, 4)]:
        assert flops.prefill(S, p) + flops.decode(S, p, c) == (flops.forward(S, p, c) - S.linear_per_token()
                                                               - S.attention(1, p + c - 1))


def test_a_group_prefills_its_prompt_once_and_backward_follows_what_trains():
    assert flops.sampling(S, [2, 5], [[3, 1], [2]]) == (flops.prefill(S, 2) + flops.decode(S, 2, 3) + flops.decode(S, 2, 1)
                                                        + flops.prefill(S, 5) + flops.decode(S, 5, 2))
    # teacher-forced rows of one prompt: its 2 positions once, then 3 and 1 completion tokens attending to it
    assert flops.group_forward(S, 2, [3, 1]) == (2 * 68 + 24) + (3 * (68 + 20) + 4 * 2 * (3 * 2 + 6)) + (
        68 + 20 + 4 * 2 * 3)
    assert flops.group_forward(S, 5, [2]) == flops.forward(S, 5, 2)  # a group of one is a row's forward
    assert flops.training(100, frozen_base=True) == 200  # inputs' gradients only
    assert flops.training(100, frozen_base=False) == 300  # and the weights'


def test_projections_head_and_attention_match_torchs_flop_counter():
    from worker.machine.hardware import decoder_shape

    cfg = LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=50, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    shape = decoder_shape(model)
    assert shape == flops.DecoderShape(layers=2, hidden=16, intermediate=24, heads=4, kv_heads=2, head_dim=4, vocab=50)
    n = 7
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 50, (1, n)))
    counted = {name: sum(c.values()) for name, c in counter.get_flop_counts().items()}
    assert counted["LlamaForCausalLM.lm_head"] == n * shape.head_per_token()
    projections = sum(v for k, v in counted.items() if k.endswith("_proj"))
    assert projections == n * shape.linear_per_token()
    # eager attention multiplies the whole n x n square, the masked half too: model FLOPs count the causal half
    full_square = 4 * shape.layers * shape.q_dim * n * n
    assert counted["Global"] == projections + counted["LlamaForCausalLM.lm_head"] + full_square
    assert shape.attention(n, 0) == 4 * shape.layers * shape.q_dim * n * (n + 1) // 2


def test_a_config_that_does_not_name_the_shapes_reports_no_utilisation():
    from transformers import GPT2Config, GPT2LMHeadModel

    from worker.machine.hardware import decoder_shape

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, bos_token_id=0, eos_token_id=0))
    assert decoder_shape(model) is None  # no intermediate_size: mfu/* left out rather than guessed


def test_measuring_the_peak_leaves_the_jobs_random_stream_alone():
    from worker.machine.hardware import peak_flops

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert peak_flops(torch.device("cpu"), torch.float64) > 0
    assert torch.equal(torch.rand(3), expected)


def test_sampling_reads_the_weights_once_a_decode_position_of_the_batch_and_each_rows_cache():
    # one layer, one kv head of 2, 2-byte values: a position's keys and values are 2 x 1 x 2 x 2 = 8 bytes
    # rows of prompt 2 with completions 3 and 1, a row of prompt 5 with 2: the longest decodes 2 positions
    # after its first token; row 1 reads 2 then 3 cached positions, row 3 reads 5
    assert flops.sampling_bytes(S, [2, 5], [[3, 1], [2]], weight_bytes=1000, value_bytes=2) == (
        1000 * (1 + 2) + 8 * ((2 + 3) + 0 + 5))
    assert flops.sampling_bytes(S, [], [], weight_bytes=1000, value_bytes=2) == 1000  # nothing decoded


def test_measuring_the_read_bandwidth_gives_a_rate():
    from worker.machine.hardware import peak_bandwidth

    assert peak_bandwidth(torch.device("cpu")) > 1e8  # bytes a second: any machine reads faster than 100 MB/s
