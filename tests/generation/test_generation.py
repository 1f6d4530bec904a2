"""The generation core: the batched KV cache (feed, rollback, fork, compaction), the step writer and stopper."""

import random

import pytest
import torch

from generation.cache import BatchedCache, record_forwards
from generation.sampling import Sampler, StepWriter, generate
from generation.specs import SamplingSpec
from generation.steps import StepStopper
from tests.conftest import stopper_agrees, tiny_llama


def _fresh(model, seq):
    return model(torch.tensor([seq]), output_hidden_states=True)


def test_rows_with_masked_columns_match_unbatched_forward(world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32, 2)
    run = BatchedCache(model, 3)
    run.seq = [[2, 5, 6, 7], [2, 9], [2, 4, 4, 4, 4, 4]]
    run.feed([0, 1, 2])
    run.seq[1] += [13, 14, 15]
    run.feed([1])
    run.rollback(1, 2)  # masks two columns of row 1
    run.seq[1] += [20]
    run.seq[2] += [21, 22]
    fed = run.feed([0, 1, 2], hidden=True, all_logits=True)
    for i in (1, 2):
        ref = _fresh(model, run.seq[i])
        torch.testing.assert_close(run.last_logits[i], ref.logits[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fed[i].hidden[0], ref.hidden_states[-1][0, fed[i].start :], atol=1e-5, rtol=1e-5)
    single = BatchedCache(model, 1)
    single.seq[0] = [2, 3, 4, 5, 6, 7]
    single.feed([0])
    single.rollback(0, 2)
    assert single.cache.get_seq_length() == 4 and single.mask.shape == (1, 4)  # one row: a plain crop
    assert single.holes == 0


def test_the_caches_own_4d_mask_gives_what_transformers_mask_gives_bit_for_bit(world_tokenizer):
    """The cache builds the 4D mask of a feed with masked columns itself (cheaper than transformers' mask
    functions); the logits and states equal those of the 2D mask transformers expands, exactly."""
    from generation.cache import own_mask_ok

    model = tiny_llama(len(world_tokenizer), 32, 2)
    runs = [BatchedCache(model, 3) for _ in range(2)]
    assert runs[0]._own_mask
    runs[1]._own_mask = False  # transformers builds the mask from the 2D column mask
    out = []
    for run in runs:
        run.seq = [[2, 5, 6, 7], [2, 9], [2, 4, 4, 4, 4, 4]]
        feeds = [run.feed([0, 1, 2], hidden=True, all_logits=True)]
        run.seq[1] += [13, 14, 15]
        feeds.append(run.feed([1], all_logits=True))
        run.rollback(1, 2)
        run.seq[1] += [20]
        run.seq[2] += [21, 22]
        feeds.append(run.feed([0, 1, 2], hidden=True, all_logits=True))
        out.append([(f.logits, f.hidden) for fed in feeds for f in fed.values()])
    for (a, ha), (b, hb) in zip(*out):
        assert torch.equal(a, b) and (ha is None or torch.equal(ha, hb))
    cfg = model.config
    assert own_mask_ok(cfg)
    for key, value in (("sliding_window", 64), ("layer_types", ["full_attention", "sliding_attention"]),
                       ("_attn_implementation", "eager")):  # a 4D mask given as-is would override these
        other = cfg.__class__.from_dict(cfg.to_dict())
        setattr(other, key, value)
        assert not own_mask_ok(other), key


def test_forwards_are_counted_with_their_rows_tokens_and_padded_positions(world_tokenizer):
    """The cost model: every forward computes all rows at the widest feed, fed or not."""
    model = tiny_llama(len(world_tokenizer), 32, 2)
    run, other = BatchedCache(model, 3), BatchedCache(model, 2)
    run.seq = [[2, 5, 6, 7], [2, 9], [2, 4, 4, 4, 4, 4]]
    with record_forwards() as log:
        run.feed([0, 1, 2])  # widths 4, 2, 6: 3 rows x 6 positions
        run.seq[1] += [13, 14]
        run.feed([0, 1, 2])  # only row 1 has pending tokens: 3 rows x 2 positions
        assert run.feed([0, 2]) == {}  # nothing pending: no forward, nothing counted
        other.seq = [[2, 3], [2]]
        other.feed([0, 1])
    run.seq[0] += [8]
    run.feed([0])  # after the block: timed by the cache, not recorded
    assert [(r.model, r.rows, r.tokens, r.positions) for r in log] == [(model, 3, 12, 18), (model, 1, 2, 6),
                                                                        (model, 2, 3, 4)]
    assert all(r.seconds > 0 for r in log) and run.forward_s > log[0].seconds + log[1].seconds
    assert run.served_s[1] == pytest.approx(log[0].seconds + log[1].seconds)
    assert run.served_s[2] == pytest.approx(log[0].seconds) and run.served_s[0] > run.served_s[2]
    run.select([2, 1])
    assert run.served_s == [pytest.approx(log[0].seconds), pytest.approx(log[0].seconds + log[1].seconds)]


def test_masked_columns_do_not_pile_up_and_compaction_is_exact(world_tokenizer):
    """Ragged feeds and rollbacks for 60 rounds: masked columns stay bounded, logits stay exact."""
    model = tiny_llama(len(world_tokenizer), 32, 2)
    rng = random.Random(0)
    run = BatchedCache(model, 4, layer_ids=(-1, 1), compact_at=0.25)
    compacted, compact = [], run.compact
    run.compact = lambda: compacted.append(compact()) or compacted[-1]
    run.prefill([[2] + [rng.randrange(3, 40) for _ in range(rng.randrange(1, 6))] for _ in range(4)])
    widest = 0
    for _ in range(60):
        rows = [i for i in range(4) if rng.random() < 0.7]
        for i in rows:
            run.seq[i] += [rng.randrange(3, 40) for _ in range(rng.randrange(1, 8))]
        run.feed(rows)
        # the feed compacted first if needed: slack is at most compact_at of the width, plus this feed's columns
        assert run.slack <= max(16, 0.25 * run.mask.shape[1]) + 7
        for i in rows:
            if rng.random() < 0.5:  # a rejected step: roll back part of what was fed
                run.rollback(i, rng.randrange(1, len(run.seq[i]) - 1 if len(run.seq[i]) > 2 else 1))
        widest = max(widest, run.mask.shape[1])
    assert any(compacted)
    longest = max(len(s) for s in run.seq)
    assert widest < 2 * longest + 64  # without compaction the width grows with every round (~250 here)
    for i in range(4):
        run.seq[i].append(7)
    fed = run.feed(range(4), hidden=True, all_logits=True)
    for i in range(4):
        ref = _fresh(model, run.seq[i])
        torch.testing.assert_close(fed[i].logits[-1], ref.logits[0, -1], atol=1e-4, rtol=1e-4)
        for k, layer in enumerate((-1, 1)):
            torch.testing.assert_close(fed[i].hidden[k, -1], ref.hidden_states[layer][0, -1], atol=1e-4, rtol=1e-4)


def test_retired_rows_leave_the_forwards_and_the_others_stay_exact(world_tokenizer):
    """A finished row is dropped from the cache's tensors; later forwards compute only the live rows,
    with the same logits, and a retired row is never fed or rolled back again."""
    model = tiny_llama(len(world_tokenizer), 32, 2)
    rng = random.Random(1)
    run = BatchedCache(model, 4, compact_at=0.25)
    run.prefill([[2] + [rng.randrange(3, 40) for _ in range(n)] for n in (3, 9, 1, 5)])
    run.seq[1] += [11, 12, 13]
    run.feed([1])
    run.rollback(1, 2)  # a masked column in row 1 before the retirement
    with record_forwards() as log:
        run.retire([0, 2])
        run.retire([2])  # already retired: nothing happens
        assert run.live == [1, 3] and run.mask.shape[0] == 2
        for _ in range(30):  # ragged feeds and rollbacks among the live rows (compaction included)
            for i in (1, 3):
                run.seq[i] += [rng.randrange(3, 40) for _ in range(rng.randrange(1, 6))]
            fed = run.feed([1, 3], all_logits=True)
            for i in (1, 3):
                torch.testing.assert_close(fed[i].logits[-1], _fresh(model, run.seq[i]).logits[0, -1],
                                           atol=1e-4, rtol=1e-4)
                if rng.random() < 0.5:
                    run.rollback(i, 1)
    assert all(r.live == 2 and r.positions % 2 == 0 for r in log)
    seq0 = list(run.seq[0])
    run.seq[0].append(5)
    with pytest.raises(ValueError, match=r"rows \[0\] were retired"):
        run.feed([0, 1])
    with pytest.raises(ValueError, match="row 2 was retired"):
        run.rollback(2, 1)
    assert run.seq[0][:-1] == seq0 and run.passes[0] == 1  # its sequence and counters stay readable
    with pytest.raises(ValueError, match="retired rows"):
        run.select([1, 3])
    run.retire([1, 3])
    assert run.live == [] and run.mask.shape[0] == 0


def test_rows_added_to_a_running_cache_read_as_if_alone_and_leave_the_others_exact(world_tokenizer):
    """A request joins a running batch between rounds (:meth:`BatchedCache.add_row`): its prompt is read in
    the next forward beside the others' tokens, every row's logits stay those of its sequence read alone, through
    rollbacks, retirements (all rows gone, then a new one) and compaction."""
    model = tiny_llama(len(world_tokenizer), 32, 2)
    rng = random.Random(3)
    run = BatchedCache(model, 2, compact_at=0.25)
    run.prefill([[2, 5, 6, 7], [2, 9]])

    def check(rows):
        fed = run.feed(rows, all_logits=True)
        for i in rows:
            torch.testing.assert_close(fed[i].logits[-1], _fresh(model, run.seq[i]).logits[0, -1], atol=1e-4,
                                       rtol=1e-4)

    for k in range(12):
        live = list(run.live)
        if k in (2, 5):
            live.append(run.add_row([2] + [rng.randrange(3, 40) for _ in range(rng.randrange(1, 9))]))
        if k == 7:
            run.retire([0])
            live.remove(0)
        for i in live:
            run.extend(i, [rng.randrange(3, 40) for _ in range(rng.randrange(1, 4))])
        check(live)
        if k % 3 == 1:
            run.rollback(live[-1], 1)
    assert run.n_rows == 4 and run.live == [1, 2, 3]
    run.retire(run.live)
    i = run.add_row([2, 8, 9])
    assert i == 4 and run.live == [4]
    check([4])
    with pytest.raises(ValueError, match="prompt is empty"):
        run.add_row([])


def test_a_row_added_after_the_only_fed_row_left_is_read_beside_the_other_new_rows(world_tokenizer):
    """An endpoint whose one decoding client left while two requests joined: the retirement cropped every column
    (no live row was fed yet) but kept layers of 0 columns, which ``add_row`` then left one row short, and the next
    forward failed ("Sizes of tensors must match"), failing every request of the loop."""
    model = tiny_llama(len(world_tokenizer), 32, 2)
    run = BatchedCache(model, 1)
    run.extend(0, [2, 5, 6, 7])
    run.feed([0])
    b = run.add_row([2, 8, 9])
    run.retire([0])
    d = run.add_row([2, 4, 4, 4])
    fed = run.feed([b, d], all_logits=True)
    for i in (b, d):
        torch.testing.assert_close(fed[i].logits[-1], _fresh(model, run.seq[i]).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_fork_gives_every_copy_the_prefix(world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32, 2)
    run = BatchedCache(model, 2)
    run.prefill([[2, 5, 6], [2, 9, 9, 9, 9]])
    run.fork(3)
    assert run.n_rows == 6 and run.seq[3] == [2, 9, 9, 9, 9]
    for i in range(6):
        run.seq[i] += [10 + i] * (i % 3 + 1)
    run.feed(range(6))
    for i in range(6):
        torch.testing.assert_close(run.last_logits[i], _fresh(model, run.seq[i]).logits[0, -1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="n=0"):
        run.fork(0)
    with pytest.raises(ValueError, match="below 6"):
        run.select([0, 6])


def test_greedy_generate_equals_transformers_generate(world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32, 2, seed=3)
    prompts = [[2, 5, 6, 7], [2, 9], [2, 4, 4, 4, 4, 4, 8]]
    ours = generate(model, prompts, max_new_tokens=10, sampling=SamplingSpec(0.0, 1.0), num_samples=2)
    for k, p in enumerate(prompts):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                             max_new_tokens=10, min_new_tokens=10, pad_token_id=0,
                             eos_token_id=None)[0, len(p):].tolist()
        assert ours[2 * k] == ours[2 * k + 1] == ref


def test_sampled_generate_is_seeded_and_forks_differ(world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32, 2, seed=3)
    def run(seed):
        return generate(model, [[2, 5, 6]], max_new_tokens=12, sampling=SamplingSpec(1.0, 1.0),
                        generator=torch.Generator().manual_seed(seed), num_samples=4)
    a, b = run(0), run(0)
    assert a == b and len(a) == 4 and len({tuple(x) for x in a}) > 1
    stop_at_7 = generate(model, [[2, 5, 6]], max_new_tokens=40, sampling=SamplingSpec(1.0, 1.0), num_samples=8,
                         generator=torch.Generator().manual_seed(1), stop=lambda t: t[-1] == 7)
    assert all((t[-1] == 7) != (len(t) == 40) or t[-1] == 7 for t in stop_at_7)
    assert all(7 not in t[:-1] for t in stop_at_7)


def test_the_writer_stops_each_row_at_its_own_limit(world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32, 2, seed=3)
    run = BatchedCache(model, 3)
    run.prefill([[2, 5], [2, 6], [2, 7]])
    writer = StepWriter(run, lambda t: False, Sampler(SamplingSpec(0.0, 1.0)))
    steps = writer.write([0, 1, 2], {0: 1, 1: 4, 2: 9}, feed_last=True)
    assert [len(steps[i].tokens) for i in range(3)] == [1, 4, 9]
    assert [len(c) for c in run.cols] == [len(s) for s in run.seq]  # feed_last: every token is in the cache


def test_stop_check_on_token_ids_agrees_with_decoding(world_tokenizer):
    stopper_agrees(world_tokenizer, ["\n\n", ".\n\n"])
    stop = StepStopper(world_tokenizer, ["\n\n"], max_step_tokens=3)
    word = world_tokenizer("seven", add_special_tokens=False).input_ids[-1]
    assert stop([word] * 3) and not stop([word] * 2)
    with pytest.raises(ValueError, match="delimiters"):
        StepStopper(world_tokenizer, [""], 8)


def test_top_p_filter_from_the_head_equals_the_full_sort():
    from generation.sampling import top_p_filter

    g = torch.Generator().manual_seed(0)
    for temp in (0.3, 1.0, 5.0):  # peaked rows stay inside the head; flat ones need the full sort
        probs = torch.softmax(torch.randn(6, 2000, generator=g) / temp, dim=-1)
        for top_p in (0.5, 0.95):
            full = top_p_filter(probs, top_p, head=probs.shape[-1])
            torch.testing.assert_close(top_p_filter(probs, top_p, head=8), full)
            torch.testing.assert_close(top_p_filter(probs, top_p), full)
            assert (full > 0).sum(-1).min() >= 1


def test_exponential_race_samples_each_row_from_its_own_stream_as_multinomial_does():
    from scipy.stats import chisquare

    from generation.sampling import exponential_race

    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4, 7, generator=g) * 1.5, dim=-1)
    probs[:, 3] = 0.0  # a token outside the nucleus is never drawn (rows stay unnormalised, as the sampler's)
    ours = [torch.Generator().manual_seed(10 + k) for k in range(4)]
    ref = [torch.Generator().manual_seed(10 + k) for k in range(4)]
    draws = torch.stack([exponential_race(probs, ours) for _ in range(4000)])  # (n, 4)
    # the same draws and the same stream positions as a per-row torch.multinomial (the sampler before it)
    again = torch.stack([torch.cat([torch.multinomial(probs[k : k + 1], 1,
                                                      generator=r) for k, r in enumerate(ref)])[:, 0]
                         for _ in range(100)])
    assert torch.equal(draws[:100], again)
    assert (draws != 3).all()
    for k in range(4):  # each row's draws follow its row's distribution
        counts = torch.bincount(draws[:, k], minlength=7).double()
        keep = probs[k] > 0
        pk = probs[k].double()
        expected = pk[keep] / pk.sum() * len(draws)
        assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3
    # a race skewed toward the first token (its probability doubled) is caught
    skewed = torch.stack([exponential_race(probs * torch.tensor([2.0, 1, 1, 1, 1, 1, 1]), ours) for _ in range(4000)])
    counts = torch.bincount(skewed[:, 0], minlength=7).double()
    keep = probs[0] > 0
    assert chisquare(counts[keep].numpy(),
                     (probs[0].double()[keep] / probs[0].double().sum() * 4000).numpy()).pvalue < 1e-6
    with pytest.raises(ValueError, match="3 generators for 4 rows"):
        exponential_race(probs, ours[:3])


def test_draws_on_another_device_come_from_twins_of_the_streams_made_once(monkeypatch):
    """A generator draws only on its device: logits elsewhere (a model on a GPU) draw from twins of the streams
    (:func:`placed`, seeded like them, made once per device); on the streams' own device nothing changes."""
    import generation.sampling as S

    own = [torch.Generator().manual_seed(s) for s in (3, 4)]
    sampler = S.Sampler(SamplingSpec(0.7, 0.9), own)
    assert sampler.streams_on(torch.device("cpu")) is own
    assert S.Sampler(SamplingSpec(0.7, 0.9)).streams_on(torch.device("cpu")) is None
    # twins restart each stream from its seed, wherever the original has got to
    torch.rand(7, generator=own[0])
    twins = S.placed(own, "cpu")
    assert [t.initial_seed() for t in twins] == [3, 4] and all(t is not g for t, g in zip(twins, own))
    fresh = torch.Generator().manual_seed(3)
    assert torch.equal(torch.rand(5, generator=twins[0]), torch.rand(5, generator=fresh))
    assert S.placed(own[1], "cpu").initial_seed() == 4
    # streams that live elsewhere: twins are made on the logits' device once, and the draws use them
    class Elsewhere:
        device = torch.device("cuda", 0)
    made = []
    def place(g, device):
        made.append(device)
        return [torch.Generator().manual_seed(10 + k) for k in range(len(g))]
    monkeypatch.setattr(S, "placed", place)
    away = S.Sampler(SamplingSpec(0.7, 0.9), [Elsewhere(), Elsewhere()])
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    first, second = away.draw(logits, [0, 1]), away.draw(logits[1:], [1])
    assert made == [torch.device("cpu")]
    ref = [torch.Generator().manual_seed(10 + k) for k in range(2)]
    here = S.Sampler(SamplingSpec(0.7, 0.9), ref)
    assert torch.equal(first, here.draw(logits, [0, 1])) and torch.equal(second, here.draw(logits[1:], [1]))
