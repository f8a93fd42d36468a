"""LoRA adapter slots on the host: which adapter holds which slot, when a slot is reused, and how the scheduler
passes over requests whose adapter must wait (pure Python, no jax)."""


from jaxserve.core.adapter_slots import AdapterSlots
from jaxserve.core.block_manager import BlockManager
from jaxserve.lora_request import LoRARequest
from tests.core.test_scheduler import make, run_step, seq

A, B, C = (LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abc"))


def with_lora(lora, **kw):
    s = seq(**kw)
    s.lora_request = lora
    return s


def test_a_slot_is_reused_only_when_no_sequence_holds_it():
    slots = AdapterSlots(2)
    s1, s2, s3 = with_lora(A), with_lora(B), with_lora(C)
    assert slots.admit(s1) and slots.admit(s2)
    assert slots.pending_loads == [(0, A), (1, B)]
    assert not slots.admit(s3) and s3.lora_slot == -1  # both slots referenced: C waits
    slots.release(s1)
    slots.pending_loads.clear()
    assert slots.admit(s3) and s3.lora_slot == 0 and slots.pending_loads == [(0, C)]  # A's slot, now unused
    again = with_lora(B)
    assert slots.admit(again) and again.lora_slot == 1 and slots.pending_loads == [(0, C)]  # resident: no reload
    assert slots.resident() == {"b": 1, "c": 0}


def test_the_least_recently_used_idle_adapter_is_evicted_first():
    slots = AdapterSlots(2)
    for lora in (A, B, A):  # B is now the least recently used
        s = with_lora(lora)
        slots.admit(s)
        slots.release(s)
    assert slots.admit(with_lora(C)) and slots.resident() == {"a": 0, "c": 1}


def test_adapters_placed_at_start_are_evicted_as_any_other_when_slots_are_wanted():
    """The server's named adapters start resident, and give way (least recently used, unreferenced) to adapters
    loaded later, as vLLM's LRU does: they kept their slots, so a load beside them was refused."""
    slots = AdapterSlots(2)
    assert slots.place(A) == 0 and slots.place(B) == 1 and slots.place(C) is None
    running = with_lora(B)
    assert slots.admit(running)  # B is the most recently used, and referenced
    assert slots.admit(with_lora(C)) and slots.resident() == {"b": 1, "c": 0}
    assert slots.pending_loads == [(0, A), (1, B), (0, C)]


def test_a_forgotten_adapter_keeps_its_slot_until_its_sequences_release_it():
    slots = AdapterSlots(2)
    slots.place(A)
    running = with_lora(A)
    assert slots.admit(running) and running.lora_slot == 0
    slots.forget(A)  # unloaded while `running` still uses slot 0
    reloaded = LoRARequest("a", 9, A.lora_path)  # the same name loaded again is another adapter
    assert slots.resident() == {}
    first, second = with_lora(reloaded), with_lora(C)
    assert slots.admit(first) and first.lora_slot == 1
    assert not slots.admit(second)  # slot 0 is still A's: C waits
    slots.release(running)
    assert slots.admit(second) and second.lora_slot == 0
    assert slots.pending_loads == [(0, A), (1, reloaded), (0, C)]


def test_scheduler_passes_over_a_sequence_whose_adapter_waits():
    s, _ = make()
    s.adapters = AdapterSlots(1)
    first, blocked, base, same = with_lora(A, max_tokens=2), with_lora(B), seq(), with_lora(A)
    for x in (first, blocked, base, same):
        s.add(x)
    out = run_step(s)
    assert [c.seq for c in out.chunks] == [first, base, same]  # B waits for the slot; later requests go on
    while not (first.finished and same.finished):
        run_step(s)
    out = run_step(s)
    assert blocked in [c.seq for c in out.chunks] and blocked.lora_slot == 0


def test_equal_tokens_under_other_roots_share_no_blocks():
    bm = BlockManager(16, 4)
    tokens = list(range(12))
    for seq_id, root in enumerate((b"", A.cache_root)):
        assert bm.match_prefix(seq_id, tokens, root) == 0
        bm.allocate(seq_id, len(tokens))
        bm.commit(seq_id, tokens, len(tokens), root)
    assert bm.match_prefix(2, tokens, A.cache_root) == 8  # same adapter: its own chain matches
    assert bm.match_prefix(3, tokens, B.cache_root) == 0
    bm.check_invariants()
