"""Why a constrained job on a GPU engine gets a token its grammar mask excluded (issue 16), measured on the GPU.

    python -m benchmarks.constrained_probe [--engine exllamav2,exllamav3] [--out DIR]   (--engine cpu: a dry run)

On an H100 both ExLlamaV engines failed `tests/test_constrained.py` the same way: the first Person job wrote
`{"name":` (three tokens, each the only one its mask allowed), then its sampler drew ":" (id 42), which the
mask after `":` excludes (it allows the 29 tokens that start with ` "`). The CPU engine, with the same
llguidance matcher, never did. This probe runs that test's jobs under several conditions and records every
sampling step of every constrained job as each library sees it: the sequence's last tokens, the logits (finite
or not, their top five, the excluded token's value), the mask the sampler was given (how many tokens, whether
it lets the drawn one through) and the drawn token, without adding a synchronisation to the step. A drawn
token outside the mask, with finite logits that favour an allowed token, puts the fault in the sampler;
logits that favour the drawn token put it in the model's view of the sequence.
Writes constrained-probe-<device>-<date>.json and prints a summary per engine and condition.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import threading
from pathlib import Path

import torch

from benchmarks.harness import device_slug, environment
from exlnb.generation import start
from exlnb.models import BUNDLED_MODEL
from exlnb.session import get_session, one_line
from tests.test_constrained import CASES, REVIEW

PERSON = CASES[0]  # (prompt, constraint, samples, sampler settings): the case that failed
WATCHED = 42  # ":", the token both engines drew


def conditions() -> dict[str, list[tuple]]:
    prompt, constraint, n, sampler = PERSON
    return {
        "the test's eight cases at once": CASES,
        "Person alone": [PERSON],
        "Person, one sample": [(prompt, constraint, 1, sampler)],
        "Person without top-p": [(prompt, constraint, n, dict(temperature=1.0))],
        "Person, greedy": [(prompt, constraint, n, dict(temperature=0.0))],
    }


def top(values: torch.Tensor, k: int = 5) -> list[list]:
    found = torch.topk(values.float(), k)
    return [[int(i), round(float(v), 3)] for v, i in zip(found.values.tolist(), found.indices.tolist())]


class Recorder:
    """Every constrained sampling step; device tensors are kept and read after the run, so no step waits."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.lock = threading.Lock()

    def add(self, step: dict) -> None:
        with self.lock:
            self.steps.append(step)

    def resolved(self) -> list[dict]:
        out = []
        for step in self.steps:
            step = dict(step)
            for key, value in list(step.items()):
                if callable(value):
                    try:
                        step[key] = value()
                    except Exception as error:  # noqa: BLE001 - a probe records what it could not read
                        step[key] = f"unreadable: {one_line(error)}"
            out.append(step)
        return out


def instrument_exllamav2(recorder: Recorder) -> callable:
    """Wrap exllamav2's sampler: it samples on the CPU, from logits the generator already copied back."""
    import inspect

    from exllamav2.generator import ExLlamaV2Sampler
    from exllamav2.generator import sampler as sampler_module

    original = ExLlamaV2Sampler.sample
    signature = inspect.signature(original)

    def sample(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        filters = arguments.get("filters") or []
        if not filters:
            return original(*args, **kwargs)
        logits = arguments["logits"].view(-1).clone()
        result = original(*args, **kwargs)
        token = int(result[0].view(-1)[0])
        allowed = getattr(filters[0], "allowed", None) or set()
        logit_filter = getattr(sampler_module._tl_tensors, "logit_filter", None)
        single = len(allowed) == 1  # exllamav2 returns the one token without sampling
        allowed_ids = torch.tensor(sorted(allowed), dtype=torch.long)
        allowed_top = [[int(allowed_ids[i]), v] for i, v in top(logits[allowed_ids], min(5, len(allowed)))] if allowed else []
        recorder.add({
            "job": id(filters[0]),
            "thread": threading.current_thread().name,
            "tail": arguments["sequence_ids"].view(-1)[-6:].tolist(),
            "random": arguments.get("random"),
            "token": token,
            "mask_size": len(allowed),
            "mask_allows_token": token in allowed,
            "mask_allows_watched": WATCHED in allowed,
            "sampler_filter_allows_token": None if single or logit_filter is None else bool(logit_filter.view(-1)[token]),
            "sampler_filter_size": None if single or logit_filter is None else int(logit_filter.sum()),
            "logits_finite": bool(torch.isfinite(logits).all()),
            "logits_top": top(logits),
            "logit_watched": round(float(logits[WATCHED]), 3),
            "allowed_top": allowed_top,
        })
        return result

    ExLlamaV2Sampler.sample = staticmethod(sample)
    return lambda: setattr(ExLlamaV2Sampler, "sample", staticmethod(original))


def instrument_exllamav3(recorder: Recorder) -> callable:
    """Wrap exllamav3's `Job.receive_logits`: it launches each job's sampler on the GPU and synchronises once for
    the whole batch afterwards, so this keeps device tensors and reads them after the run."""
    from exllamav3.generator.job import Job

    from exlnb.engines.exllamav3_filter import allowed_count, allows

    original = Job.receive_logits

    def receive_logits(self, logits):
        if not self.filters:
            return original(self, logits)
        mask = self.device_logit_mask
        mask = None if mask is None else mask.clone()
        host_mask = getattr(self.filters[0], "allowed", None)
        host_mask = None if host_mask is None else host_mask.clone()
        flat = logits.view(-1).float().clone()
        seq = self.sequences[0].sequence_ids
        tail = seq.torch_slice(max(len(seq) - 6, 0), None).view(-1).tolist()
        result = original(self, logits)
        drawn = result[0].clone()  # the sampler may reuse its output buffer

        def token() -> int:
            return int(drawn.view(-1)[0])

        def device_mask(fn):
            if mask is None:
                return lambda: None
            return lambda: fn(mask.cpu()) if mask.dtype == torch.int32 else f"dense {mask.dtype}"

        recorder.add({
            "job": self.identifier,
            "new_tokens": self.new_tokens,
            "tail": tail,
            "token": token,
            "mask_size": device_mask(allowed_count),
            "mask_allows_token": device_mask(lambda m: allows(m, token())),
            "mask_allows_watched": device_mask(lambda m: allows(m, WATCHED)),
            "host_mask_size": None if host_mask is None else allowed_count(host_mask),
            "host_mask_allows_token": (lambda: None) if host_mask is None else (lambda: allows(host_mask, token())),
            "host_mask_equals_device": (lambda: None) if host_mask is None or mask is None
            else (lambda: bool(torch.equal(host_mask.view(-1), mask.cpu().view(-1)[: host_mask.numel()]))),
            "logits_finite": lambda: bool(torch.isfinite(flat).all()),
            "logits_top": lambda: top(flat),
            "logit_watched": lambda: round(float(flat[WATCHED]), 3),
        })
        return result

    Job.receive_logits = receive_logits
    return lambda: setattr(Job, "receive_logits", original)


INSTRUMENTS = {"exllamav2": instrument_exllamav2, "exllamav3": instrument_exllamav3}


def run_condition(cases: list[tuple], recorder: Recorder) -> dict:
    """The test's jobs, seeded as the test seeds them; a case whose sampler settings the engine refuses is
    left out, as the test leaves it out."""
    generations, refused = [], []
    for i, (prompt, constraint, n, sampler) in enumerate(cases):
        try:
            generations.append(start(prompt, **constraint, n=n, seed=10 * i, max_new_tokens=64, **sampler))
        except ValueError as error:
            refused.append(one_line(error))
    jobs, failed = 0, []
    for generation in generations:
        for result in generation.wait(300):
            jobs += 1
            if result.error:
                failed.append({"job_id": result.job_id, "token_ids": list(result.token_ids), "error": result.error})
    steps = recorder.resolved()
    outside = [s for s in steps if s.get("mask_allows_token") is False]
    return {"jobs": jobs, "refused": refused, "failed": failed, "steps": len(steps), "drawn_outside_mask": outside,
            "first_steps": steps[:40]}


def probe(engine: str) -> dict:
    session = get_session()
    session.load(BUNDLED_MODEL, engine=engine, progress=False)
    results = {}
    for name, cases in conditions().items():
        recorder = Recorder()
        restore = INSTRUMENTS.get(engine, lambda _: lambda: None)(recorder)  # the CPU engine: a dry run
        try:
            results[name] = run_condition(cases, recorder)
        except Exception as error:  # noqa: BLE001 - the next condition may still say something
            results[name] = {"error": one_line(error)}
        finally:
            restore()
            session.cancel_all()
        summary = results[name]
        print(f"{engine:10} {name:32} jobs {summary.get('jobs')} failed {len(summary.get('failed', []))} "
              f"drawn outside the mask {len(summary.get('drawn_outside_mask', []))} {summary.get('error', '')}")
        for step in summary.get("drawn_outside_mask", [])[:3]:
            print("   ", json.dumps(step))
    session.unload()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="exllamav2,exllamav3")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    engines = [e for e in args.engine.split(",") if e == "cpu" or importlib.util.find_spec(e) is not None]
    if engines != ["cpu"] and not torch.cuda.is_available():
        print("constrained_probe needs a CUDA GPU for the ExLlamaV engines: this machine has none (--engine cpu runs dry)")
        return 2
    out = args.out.resolve()
    env = environment()
    with tempfile.TemporaryDirectory() as work:  # the test's file-schema case reads review.json from here
        Path(work, "review.json").write_text(json.dumps(REVIEW))
        os.chdir(work)
        report = {"environment": env, "engines": {engine: probe(engine) for engine in engines}}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"constrained-probe-{device_slug(env)}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
