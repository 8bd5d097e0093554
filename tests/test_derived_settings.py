"""Settings the launcher derives or checks against the machine before any worker starts:
confirm_s under coordinator=etcd (derived when unset), startup_timeout_s against the model's
estimated start-up (launcher/startup.py), and the bad inputs of issue 37 item 5."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import yaml

from launcher import cli
from launcher.derive import etcd_confirm_s
from launcher.recipes import RecipeError, load, resolve

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
    import launcher.launch
    seen = []
    monkeypatch.setattr(launcher.launch, "train", lambda cfg: seen.append(cfg) or {"status": "ok"})
    assert cli.main(["train", "tiny-llama", *ETCD]) == 0
    assert seen[0].checkpointless.confirm_s == 9
    assert "[launcher] checkpointless.confirm_s=9: derived" in capsys.readouterr().out
