"""Scheduler and block manager alone: pure Python, no model."""
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.sequence import Request, SequenceStatus
from pagedserve.sampling_params import SamplingParams


def _req(i, n_tokens, **kw):
    return Request(str(i), None, list(range(10, 10 + n_tokens)), SamplingParams(**kw))


def _run_step(sch, out):
    """Pretend the model ran: mark tokens computed; sequences that finished their prompt get one token."""
    for e in out.scheduled:
        e.seq.num_computed_tokens = e.start + e.num_new_tokens
        if e.seq.num_computed_tokens == e.seq.num_tokens:
            e.seq.token_ids.append(7)


def test_token_budget_and_chunked_prefill():
    bm = BlockManager(100, 16, False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=50, enable_chunked_prefill=True)
    a, b = _req(0, 120), _req(1, 10)
    sch.add(a.seqs[0])
    sch.add(b.seqs[0])
    out = sch.schedule()
    assert [(e.seq.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("0", 50)]
    _run_step(sch, out)
    out = sch.schedule()
    assert [(e.seq.request.request_id, e.start, e.num_new_tokens) for e in out.scheduled] == [("0", 50, 50)]
    _run_step(sch, out)
    out = sch.schedule()  # last 20 of the prompt, then the short request fits in the rest of the budget
    assert [(e.seq.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("0", 20), ("1", 10)]
    _run_step(sch, out)
    out = sch.schedule()  # both decode now
    assert [e.num_new_tokens for e in out.scheduled] == [1, 1]


def test_no_chunking_waits_for_a_whole_prompt():
    bm = BlockManager(100, 16, False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=False)
    sch.add(_req(0, 40).seqs[0])
    sch.add(_req(1, 40).seqs[0])
    out = sch.schedule()
    assert [e.num_new_tokens for e in out.scheduled] == [40]


def test_preempts_most_recent_and_frees_its_blocks():
    bm = BlockManager(6, 16, False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000, enable_chunked_prefill=True)
    seqs = [_req(i, 32).seqs[0] for i in range(3)]
    for s in seqs:
        sch.add(s)
    out = sch.schedule()
    assert len(out.scheduled) == 3 and bm.num_free_blocks == 0
    _run_step(sch, out)  # each now has 33 tokens: needs a third block
    out = sch.schedule()
    assert out.preempted == [seqs[2]]
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].num_computed_tokens == 0 and not seqs[2].block_table
    assert [e.seq for e in out.scheduled] == [seqs[0], seqs[1]]
    assert sch.waiting[0] is seqs[2]
    assert sch.num_preemptions == 1


def test_max_num_seqs_limits_admission():
    bm = BlockManager(100, 16, False)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=1000, enable_chunked_prefill=True)
    for i in range(4):
        sch.add(_req(i, 5).seqs[0])
    assert len(sch.schedule().scheduled) == 2 and len(sch.waiting) == 2


def test_prefix_cache_hits_eviction_and_refcounts():
    bm = BlockManager(8, 4, True)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000, enable_chunked_prefill=True)
    a = _req(0, 13).seqs[0]
    sch.add(a)
    _run_step(sch, sch.schedule())
    assert bm.hit_tokens == 0 and len(bm.cached) == 3
    b = _req(1, 14).seqs[0]  # same first 13 tokens
    sch.add(b)
    out = sch.schedule()
    e = [x for x in out.scheduled if x.seq is b][0]
    assert e.start == 12 and e.num_new_tokens == 2  # three full blocks reused
    assert b.block_table[:3] == a.block_table[:3] and all(bm.ref_counts[x] == 2 for x in a.block_table[:3])
    sch.remove(a)
    sch.remove(b)
    assert bm.num_free_blocks == 8 and len(bm.cached) >= 3  # freed, still cached
    big = _req(2, 30, max_tokens=1).seqs[0]  # needs all 8 blocks: evicts the cache
    big.token_ids = list(range(500, 530))
    sch.add(big)
    sch.schedule()
    assert bm.num_free_blocks == 0
    assert all(key[1][0] >= 500 for key in bm.cached)  # the old prefix was evicted; only big's blocks remain


def test_prefix_cache_counts_a_waiting_request_once():
    """A request that waits for blocks looks the cache up every step; only the lookup of the step
    that admits it counts, so the hit rate does not sink while requests queue."""
    bm = BlockManager(4, 4, True)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000, enable_chunked_prefill=True)
    a = _req(0, 13).seqs[0]  # all 4 blocks
    sch.add(a)
    _run_step(sch, sch.schedule())
    b = _req(1, 9).seqs[0]  # shares a's first blocks
    c = _req(2, 9).seqs[0]
    c.token_ids = list(range(600, 609))  # matches nothing; needs 3 blocks
    sch.add(c)
    sch.add(b)
    for _ in range(3):
        _run_step(sch, sch.schedule())  # a decodes; c (no match) and b wait
        assert sch.waiting[0] is c and bm.query_tokens == 13 and bm.hit_tokens == 0
    sch.remove(a)
    out = sch.schedule()
    assert [e.seq for e in out.scheduled] == [c]
    assert bm.query_tokens == 13 + 9 and bm.hit_tokens == 0
    sch.remove(c)
    out = sch.schedule()
    assert [e.seq for e in out.scheduled] == [b]
    assert bm.query_tokens == 13 + 9 + 9 and bm.hit_tokens == out.scheduled[0].start > 0  # what it reused
