"""Settings the launcher derives or checks against the machine before any worker starts:
confirm_s under coordinator=etcd (derived when unset), startup_timeout_s against the model's
estimated start-up (launcher/plan/startup.py), and the bad inputs of issue 37 item 5."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import yaml

from launcher import cli
from launcher.recipe.derive import etcd_confirm_s
from launcher.recipe.load import RecipeError, load, resolve

ETCD = ["distributed.num_nodes=3", "distributed.nproc_per_node=2", "checkpointless.spare_nodes=1",
        "distributed.master_port=29400", "checkpointless.coordinator=etcd",
        "checkpointless.etcd.member_hosts=a,b,c"]


def test_etcd_derives_confirm_s_when_unset_and_says_so():
    cfg, notes = resolve("tiny-llama", ETCD)
    c = cfg.checkpointless
    assert c.confirm_s == 9 == etcd_confirm_s(3, 3)  # ceil(3 + 3 + 3)
    assert c.confirm_s > c.node_timeout_s + c.etcd.ttl_s + 2 and c.node_timeout_s < c.confirm_s
    assert len(notes) == 1 and notes[0].startswith("checkpointless.confirm_s=9: derived")
    # it follows the keys it is derived from, fractions rounded up
    cfg = load("tiny-llama", ETCD + ["checkpointless.node_timeout_s=4.5",
                                     "checkpointless.etcd.ttl_s=5"])
    assert cfg.checkpointless.confirm_s == 13
    # a `~key` deletion leaves it unset, so derived too
    assert load("tiny-llama", ETCD + ["checkpointless.confirm_s=30",
                                      "~checkpointless.confirm_s"]).checkpointless.confirm_s == 9


def test_a_confirm_s_set_by_hand_is_kept_or_refused_never_replaced():
    assert load("tiny-llama", ETCD + ["checkpointless.confirm_s=20"]).checkpointless.confirm_s == 20
    _, notes = resolve("tiny-llama", ETCD + ["checkpointless.confirm_s=20"])
    assert notes == []
    for low in ("5", "8"):  # even the default's value, when written, is the user's
        with pytest.raises(RecipeError) as err:
            load("tiny-llama", ETCD + [f"checkpointless.confirm_s={low}"])
        text = str(err.value)
        assert text.startswith(f"checkpointless.confirm_s={float(low)}: must exceed")
        assert "Fix: checkpointless.confirm_s=9" in text


def test_a_confirm_s_in_the_recipe_file_counts_as_set(tmp_path):
    own = tmp_path / "mine.yaml"
    own.write_text("extends: tiny-llama\ncheckpointless: {confirm_s: 6}\n")
    with pytest.raises(RecipeError, match=r"^checkpointless.confirm_s=6.0: must exceed"):
        load(str(own), ETCD)


def test_the_store_coordinator_keeps_the_default():
    cfg, notes = resolve("tiny-llama")
    assert cfg.checkpointless.confirm_s == 5 and notes == []


def test_show_validate_and_train_see_the_derived_value(capsys, monkeypatch):
    assert cli.main(["show", "tiny-llama", *ETCD]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# checkpointless.confirm_s=9: derived")
    assert yaml.safe_load(out)["checkpointless"]["confirm_s"] == 9  # still a recipe
    assert cli.main(["validate", "tiny-llama", *ETCD]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok      tiny-llama\n") and "checkpointless.confirm_s=9: derived" in out
    assert cli.main(["validate", "tiny-llama", *ETCD, "checkpointless.confirm_s=5"]) == 1
    assert "INVALID tiny-llama: checkpointless.confirm_s=5.0" in capsys.readouterr().out
    import launcher.run.launch
    seen = []
    monkeypatch.setattr(launcher.run.launch, "train", lambda cfg: seen.append(cfg) or {"status": "ok"})
    assert cli.main(["train", "tiny-llama", *ETCD]) == 0
    assert seen[0].checkpointless.confirm_s == 9
    assert "[launcher] checkpointless.confirm_s=9: derived" in capsys.readouterr().out


def _facts(n_params: int, param_bytes: int = 2):
    from types import SimpleNamespace
    return SimpleNamespace(n_params=n_params, param_bytes=param_bytes)


def test_the_startup_estimate_follows_the_model_and_how_it_is_loaded():
    from launcher.plan.startup import IMPORT_S, estimate
    tiny = estimate(load("tiny-llama"), _facts(10**6, 4), "cpu")
    assert IMPORT_S["cpu"] <= tiny.seconds < IMPORT_S["cpu"] + 1  # the imports, nearly all
    assert estimate(load("tiny-llama"), _facts(10**6, 4), "cuda").seconds >= IMPORT_S["cuda"]
    eight = 8 * 10**9
    ddp = estimate(load("llama3-8b", ["distributed.strategy=ddp"]), _facts(eight), "cuda")
    fsdp = estimate(load("llama3-8b"), _facts(eight), "cuda")
    random = estimate(load("llama3-8b", ["model.init=random"]), _facts(eight), "cuda")
    assert "reading 16.0 GB of the checkpoint" in ddp.says()  # whole, once per node
    assert "reading 16.0 GB" in fsdp.says()  # 8 ranks on one node: every slice
    assert ddp.seconds > fsdp.seconds > random.seconds and "reading" not in random.says()
    # the same job over 8 nodes: each node reads its eighth
    spread = estimate(load("llama3-8b", ["distributed.num_nodes=8", "distributed.nproc_per_node=1",
                                         "distributed.master_port=29400"]), _facts(eight), "cuda")
    assert "reading 2.0 GB" in spread.says() and spread.seconds < fsdp.seconds
    assert estimate(load("llama3-8b"), _facts(10 * eight), "cuda").seconds > fsdp.seconds


def test_a_startup_timeout_below_the_estimate_is_refused_naming_key_value_estimate_and_fix():
    from launcher.plan.startup import estimate, startup_problem
    cfg = load("llama3-8b", ["checkpointless.startup_timeout_s=60"])
    est = estimate(cfg, _facts(8 * 10**9), "cuda")
    said = startup_problem(cfg, est)
    assert said.startswith("checkpointless.startup_timeout_s=60: a worker of this recipe needs "
                           f"about {est.seconds:.0f} s here")
    assert f"Fix: checkpointless.startup_timeout_s={est.enough()}" in said
    assert est.enough() >= est.seconds and "\n" not in said
    assert startup_problem(load("llama3-8b"), est) is None  # the default, 600 s
    # a model that cannot be built here is not judged: the workers say why, in their words
    odd = load("tiny-llama", ["model.config.num_attention_heads=3",
                              "checkpointless.startup_timeout_s=1"])
    assert startup_problem(odd) is None
    assert startup_problem(load("llama3-8b", [f"checkpointless.startup_timeout_s="
                                              f"{est.seconds + 1:.0f}"]), est) is None


def test_preflight_and_validate_refuse_a_startup_timeout_too_short_for_the_model(capsys):
    from launcher.run.preflight import preflight
    with pytest.raises(RecipeError) as err:
        preflight(load("tiny-llama", ["checkpointless.startup_timeout_s=5"]))
    assert "checkpointless.startup_timeout_s=5: a worker of this recipe needs about 15 s" in \
        str(err.value)
    preflight(load("tiny-llama", ["checkpointless.startup_timeout_s=30"]))  # as docs/recovery.md
    assert cli.main(["validate", "tiny-llama", "checkpointless.startup_timeout_s=5"]) == 1
    assert "INVALID tiny-llama: checkpointless.startup_timeout_s=5" in capsys.readouterr().out
    assert cli.main(["plan", "tiny-llama", "checkpointless.startup_timeout_s=5"]) == 1
    out = capsys.readouterr().out
    assert "start-up: about 15 s a worker" in out and out.rstrip().endswith("TOO LOW")


def test_every_shipped_recipe_that_fits_starts_within_the_default_timeout():
    from launcher.plan import model_facts, plan
    from launcher.plan.startup import estimate
    for name in ("tiny-llama", "llama3-8b", "llama3-70b", "gpt-oss-20b"):  # the largest loads
        cfg = load(name)
        facts = model_facts(cfg)
        if plan(cfg, facts, search=False).fits:
            est = estimate(cfg, facts, "cuda" if cfg.distributed.device == "cuda" else "cpu")
            assert est.seconds < cfg.checkpointless.startup_timeout_s == 600, (name, est.says())


def test_the_bad_inputs_of_issue_37_item_5():
    """Checked already (tests/launcher/test_recipes.py, tests/library/control/test_stragglers.py), said again in one place:
    a slow fault's factor above 1, named by fault; validate's overrides and --help."""
    for factor in ("0", "1", "0.5"):
        with pytest.raises(RecipeError, match=r"^faults\[0\]\.factor=.*must be > 1"):
            load("tiny-llama", [f"faults=[slow:2:5:{factor}]"])
    assert load("tiny-llama", ["faults=[slow:2:5:1.5]"]).faults[0].factor == 1.5
    assert cli.main(["validate", "--help"]) == 0


def test_the_library_command_line_names_the_slow_fault_it_refuses(capsys):
    from checkpointless.__main__ import _checked, _parser
    for bad, said in [("slow:1:3:0", "--fault slow:1:3:0: factor=0 must be > 1"),
                      ("slow:1:3:x", "fault 'slow:1:3:x': rank, step and seed")]:
        with pytest.raises(SystemExit) as ended:
            _checked(_parser(), ["--nproc", "2", "--fault", "kill:1:3", "--fault", bad, "x.py"])
        assert ended.value.code == 2 and said in capsys.readouterr().err
    _, faults = _checked(_parser(), ["--nproc", "2", "--fault", "slow:1:3:2", "x.py"])
    assert faults[0]["factor"] == 2.0
