"""`dflash serve`'s library call (launch/serving.py): the engine's limits are checked before anything loads, and
`build_server` wires the recipe's target, drafter, decode plan (its `serve` section) and sampling into a bound
server. Serving itself, with its printed line and signals, runs in tests/test_eval.py through `dflash serve`
subprocesses."""

from __future__ import annotations

import subprocess
import sys

import pytest
from flax import nnx

from dflash.configs.recipe import load_recipe
from dflash.launch.serving import ServeOptions, build_server, build_servers
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import load_target
from dflash.models.zlab import save_zlab
from dflash.serve.plan import AR, Chain

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


def test_limits_are_checked_before_anything_loads():
    assert (ServeOptions().prefill_chunk, ServeOptions().steps_per_dispatch) == (512, 4)
    limits = ServeOptions(prefill_chunk=0, steps_per_dispatch=1).limits(64)
    assert (limits.prefill_chunk, limits.steps_per_dispatch, limits.max_len) == (None, 1, 64)
    for c in (8, 100, -16, True, 64.0):
        with pytest.raises(ValueError, match=rf"prefill_chunk must be None or a power of two >= 16; received {c!r}"):
            ServeOptions(prefill_chunk=c).limits(64)
    for r in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=rf"steps_per_dispatch must be an integer >= 1; received {r!r}"):
            ServeOptions(steps_per_dispatch=r).limits(64)
    recipe = load_recipe("tiny")
    with pytest.raises(ValueError, match="slots must be an integer >= 1; received 0"):
        build_server(recipe, ServeOptions(slots=0, drafter="/nonexistent"))  # refused before the target loads
    with pytest.raises(ValueError, match="slots must be an integer >= 1 or 'auto'; received 'many'"):
        build_server(recipe, ServeOptions(slots="many", drafter="/nonexistent"))


def test_auto_slots_fit_half_the_free_memory_up_to_the_cap():
    """`--slots auto` (`auto_slots`): the largest power of two whose slots fit half the free memory, at most 64 on an
    accelerator and 8 on CPU, at least 1; the line names the bound."""
    from dflash.launch.cli import _slots_arg
    from dflash.launch.serving import auto_slots

    gib = 1 << 30
    assert auto_slots(gib, 16 * gib, cpu=False) == (8, auto_slots(gib, 16 * gib, cpu=False)[1])
    assert auto_slots(gib, 17.9 * gib, cpu=False)[0] == 8  # 16 slots need 16 GiB > half of 17.9
    assert auto_slots(gib, 1000 * gib, cpu=False)[0] == 64
    assert auto_slots(gib, 1000 * gib, cpu=True)[0] == 8
    assert auto_slots(gib, gib, cpu=False)[0] == 1  # not even one fits half: one slot, the engine's own error if none
    n, line = auto_slots(gib // 4, 3 * gib, cpu=False)
    assert n == 4 and "0.250 GiB per device" in line and "bound by 50% of the free memory" in line
    assert "bound by the cap on CPU devices" in auto_slots(1, gib, cpu=True)[1]
    assert (_slots_arg("auto"), _slots_arg("16")) == ("auto", 16)
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(Exception, match=f"must be an integer >= 1 or 'auto'; received '{bad}'"):
            _slots_arg(bad)


def test_the_map_limit_note_warns_only_near_the_limit(tmp_path):
    """`map_limit_note`: silent below 80% of vm.max_map_count and where the files are missing; past it, a warning
    naming both counts, the crash XLA's CPU JIT ends in, and the sysctl that raises the limit."""
    from dflash.launch.serving import map_limit_note

    maps, limit = tmp_path / "maps", tmp_path / "max_map_count"
    limit.write_text("1000\n")
    maps.write_text("x\n" * 799)
    assert map_limit_note(maps, limit) is None
    maps.write_text("x\n" * 800)
    note = map_limit_note(maps, limit)
    assert note and "800 memory maps of the 1000" in note and "Unable to allocate section memory" in note
    assert "sysctl -w vm.max_map_count=" in note
    assert map_limit_note(tmp_path / "absent", limit) is None and map_limit_note(maps, tmp_path / "absent") is None


def test_slots_auto_is_sized_from_the_slot_bytes_and_the_free_memory(monkeypatch, capsys):
    """A server built with slots "auto" (the default) takes the count `auto_slots` gives for its own slot bytes
    (`launch.resident.slot_bytes`: the K/V pages and per-slot arrays one more slot adds, measured here against the
    engine's real state) and the devices' free memory."""
    import jax

    from dflash.launch import serving
    from dflash.launch.resident import slot_bytes

    recipe = load_recipe("tiny")
    target = load_target(recipe.target)
    per_slot = slot_bytes(target.cfg, None, recipe.target.max_seq_len, target.params["embed"].dtype)
    monkeypatch.setattr(serving, "free_bytes", lambda devices: 4 * per_slot + 1)  # half of it: 2 slots
    server = build_server(recipe, ServeOptions(ar=True, port=0, precompile=False))
    try:
        engine = server.worker.engine
        assert engine.slots == 2
        held = sum(x.nbytes for x in jax.tree.leaves(engine.state))
        one = serving.Engine(target.params, target.cfg, None, AR(), ServeOptions().limits(recipe.target.max_seq_len, 1))
        assert held - sum(x.nbytes for x in jax.tree.leaves(one.state)) == per_slot  # the accounting is the engine's
    finally:
        server.worker.shutdown()
        server.server_close()
    assert "slots: auto -> 2 (" in capsys.readouterr().out


def _built(recipe, options):
    server = build_server(recipe, options)
    try:
        return server.worker.engine.k, server.model_name, server.protocol, server.api_key
    finally:
        server.worker.shutdown()
        server.server_close()


@pytest.mark.slow
def test_build_server_wires_the_recipe_and_the_options(tmp_path):
    recipe = load_recipe("tiny")
    drafter = DFlashDrafter(load_target(recipe.target).drafter_arch(recipe.drafter), nnx.Rngs(0))
    save_zlab(drafter, tmp_path)
    k, name, protocol, key = _built(load_recipe("tiny", ["serve.block_size=4"]),
                                    ServeOptions(drafter=tmp_path, port=0, api_key="k"))
    assert (k, name, key) == (4, recipe.target.source, "k")
    assert (protocol.max_tokens, protocol.unknown_fields) == (None, "ignore")  # max_tokens left to the context
    k, *_ = _built(recipe, ServeOptions(drafter=tmp_path, port=0))
    assert k == recipe.drafter.block_size  # block_size 0: the drafter's training K
    k, name, protocol, key = _built(recipe, ServeOptions(ar=True, port=0, model_name="x", unknown_fields="reject"))
    assert (k, name, protocol.unknown_fields, key) == (1, "x", "reject", None)


def test_draft_rule_is_checked_and_reaches_the_engine(tmp_path):
    """serve.draft_rule (the recipe; `dflash serve --draft-rule` overrides it) sets the engine's rule for sampled
    requests; an unknown rule is refused by name, "sample" with a tree is a sampled tree (D84); AR serves with no
    drafts at all."""
    from dflash.configs.schema import ConfigError
    from dflash.serve.config import ServeConfig

    assert ServeConfig(tree_nodes=4, draft_rule="sample").draft_rule == "sample"
    with pytest.raises(ConfigError, match="serve.draft_rule"):
        ServeConfig(draft_rule="top1")
    recipe = load_recipe("tiny", ["serve.draft_rule=sample"])
    drafter = DFlashDrafter(load_target(recipe.target).drafter_arch(recipe.drafter), nnx.Rngs(0))
    save_zlab(drafter, tmp_path)

    def plan(recipe, options):
        server = build_server(recipe, options)
        try:
            return server.worker.engine.plan
        finally:
            server.worker.shutdown()
            server.server_close()

    assert plan(recipe, ServeOptions(drafter=tmp_path, port=0, precompile=False)) == Chain(recipe.drafter.block_size,
                                                                                           "sample")
    argmax = load_recipe("tiny", ["serve.draft_rule=sample", "serve.draft_rule=argmax"])
    assert plan(argmax, ServeOptions(drafter=tmp_path, port=0, precompile=False)).rule == "argmax"
    assert plan(recipe, ServeOptions(ar=True, port=0, precompile=False)) == AR()


@pytest.mark.parametrize("devices", [1, 2])
def test_an_ar_port_serves_the_target_alone_over_the_same_weights(tmp_path, devices):
    """`dflash serve --ar-port`: a second server in the process, AR, whose engine holds the very arrays of the
    DFlash engine's target (one copy of the weights on the chip); a port clash is refused before anything loads."""
    import jax

    recipe = load_recipe("tiny")
    with pytest.raises(ValueError, match="--ar-port must be another port than --port"):
        build_servers(recipe, ServeOptions(drafter="/nonexistent", port=8123, ar_port=8123))
    drafter = DFlashDrafter(load_target(recipe.target).drafter_arch(recipe.drafter), nnx.Rngs(0))
    save_zlab(drafter, tmp_path)
    servers = build_servers(recipe, ServeOptions(drafter=tmp_path, port=0, ar_port=0, precompile=False,
                                                 devices=devices))
    try:
        spec, ar = (s.worker.engine for s in servers)
        assert isinstance(spec.plan, Chain) and ar.plan == AR() and ar.models.drafter_params is None
        assert servers[0].server_address[1] != servers[1].server_address[1]
        assert servers[0].model_name == servers[1].model_name == recipe.target.source
        same = jax.tree.map(lambda a, b: a is b, spec.models.target_params, ar.models.target_params)
        assert all(jax.tree.leaves(same))
    finally:
        for server in servers:
            server.worker.shutdown()
            server.server_close()


def test_the_serve_path_imports_no_checkpoint_library():
    """Orbax (the trainer's checkpoints) is imported only where a run dir is read: `dflash serve`'s modules leave it
    out (~0.5 s of a warm start; docs/benchmarks.md "Serve start-up")."""
    code = ("import sys\nfrom dflash.launch import cli, serving\nfrom dflash.models import drafter_io, target\n"
            "assert not [m for m in sys.modules if m.startswith('orbax')], 'orbax imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
