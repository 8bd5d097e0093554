"""The worker's step (launcher/train/strategy.py, step.py, micro.py): a strategy chosen once per
generation from the job's layout, one micro-batch routine for the loop and the audit replay, and a
loop with no branch on the parallelism."""
import ast

from tests.conftest import ROOT
from tests.launcher.test_loop_accelerator import PREAMBLE, run_worker

WORKER = PREAMBLE + r"""
from checkpointless.worker.job import Job as RealJob

class Job:  # what the loop's pieces read of a supervised job
    rank, world_size, is_replacement, data_rank, seed = 0, 1, False, 0, int(cfg.run.seed)
    shrunk, spec = False, types.SimpleNamespace(shrink="off")

    def process_env(self):
        return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1"}

    seed_step = RealJob.seed_step  # the job's own seeding rule

class Sampler:  # rows that depend on (step, share, world, micro)
    def batch(self, step, share, world, micro):
        g = torch.Generator().manual_seed(((step * 31 + share) * 7 + world) * 5 + micro)
        return {"x": torch.randn(4, 8, generator=g)}

class Out:
    def __init__(self, loss):
        self.loss = loss

class Tiny(torch.nn.Module):  # dropout: the seeding shows in the gradients
    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1), torch.nn.Dropout(0.3)

    def forward(self, x):
        return Out(self.b(self.drop(torch.relu(self.a(x)))).float().pow(2).mean())

from launcher.train.accelerator import build_accelerator
from launcher.train.micro import MicroBatch
acc = build_accelerator(cfg, Job(), device)

def grads(micro):
    torch.manual_seed(0)
    model = Tiny()
    loss_sum = torch.zeros(1)
    for m in range(3):
        micro(model, 5, 1, 2, m, loss_sum)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]), loss_sum

loop_g, loop_l = grads(MicroBatch.of_loop(Job(), acc, Sampler()))
replay_g, replay_l = grads(MicroBatch.of_recipe(cfg, Sampler(), device))
other = MicroBatch.of_recipe(cfg, Sampler(), device)
other_g, _ = grads(MicroBatch(other.sampler, device, lambda s, m, sh: torch.manual_seed(99),
                              other.autocast, other.backward))

from launcher.train import strategy
def chosen(strategy_name, shrink, shrunk=False, pp=False):
    c = load("tiny-llama", ["distributed.strategy=" + strategy_name, "distributed.num_processes=4"])
    job = types.SimpleNamespace(shrunk=shrunk, spec=types.SimpleNamespace(shrink=shrink))
    return type(strategy.choose(c, job, pp)).__name__

print(json.dumps({
    "same": torch.equal(loop_g, replay_g) and torch.equal(loop_l, replay_l),
    "seed_matters": not torch.equal(loop_g, other_g),
    "choices": [chosen("ddp", "off"), chosen("ddp", "exact"), chosen("ddp", "fast"),
                chosen("ddp", "fast", shrunk=True), chosen("fsdp", "off"),
                chosen("fsdp", "exact"), chosen("hsdp", "exact"), chosen("ddp", "off", pp=True),
                chosen("fsdp", "exact", pp=True)]}))
"""


def test_the_replay_runs_the_loops_micro_batches_bit_for_bit_and_the_strategy_is_chosen(tmp_path):
    """An audit replays a rank's step on a spare without an Accelerator: its micro-batch routine
    is the loop's with the seeding, autocast and backward built from the recipe, and must give
    the loop's gradients and loss bit for bit (bf16, three accumulated micro-batches, dropout),
    or a healthy rank would be accused of silent corruption."""
    got = run_worker(WORKER, tmp_path, threads=1)
    assert got["same"] and got["seed_matters"]
    assert got["choices"] == ["DataParallel", "Logical", "DataParallel", "Logical", "Sharded",
                              "LogicalSharded", "LogicalSharded", "Pipelined", "Pipelined"]


PARALLELISM = {"strategy", "pp_size", "tp_size", "shrink", "pipe", "logical_fsdp", "overlapped",
               "SHARDED", "shrunk"}


def _branches_on_parallelism(fn: ast.FunctionDef) -> list[str]:
    out = []
    for node in ast.walk(fn):
        test = getattr(node, "test", None)  # if, while, conditional expressions
        if test is None:
            continue
        names = {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)} | \
            {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        if names & PARALLELISM:
            out.append(f"{fn.name}:{node.lineno} {ast.unparse(test)}")
    return out


def test_the_loops_step_has_no_branch_on_the_parallelism():
    tree = ast.parse((ROOT / "launcher/train/loop.py").read_text())
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert {"train", "train_step"} <= set(fns)
    assert [b for name in ("train", "train_step") for b in _branches_on_parallelism(fns[name])] \
        == []
    # the check fails when broken: a branch on the pipeline inside a step
    broken = ast.parse("def train_step(run, step):\n    if run.pipe:\n        pass\n").body[0]
    assert _branches_on_parallelism(broken) == ["train_step:2 run.pipe"]


def test_one_micro_batch_routine_runs_every_forward_of_the_worker():
    """No module of the worker's step runs a model's forward itself: each goes through
    micro.py (the pipeline's schedule runs its stages' forwards; evaluation has no backward)."""
    own = []
    for path in sorted((ROOT / "launcher/train").glob("*.py")):
        if path.name in ("micro.py", "evaluate.py", "pipeline.py", "export.py"):
            continue
        text = path.read_text()
        if ".loss" in text and "backward(" in text:
            own.append(path.name)
    assert own == []
