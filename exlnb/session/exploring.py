"""Exploring: a prompt's samples grown into one `SampleTree`, then expanded or forced at any node.

`grow_tree` submits N samples of one prompt in one engine command, so they share the prompt's pages (the engine
queues what its batch cannot hold yet), and merges their tokens into the tree as they stream, on one thread per
launch; a listener hears each merge (the tree view redraws from it). `TreeGrowth.expand` branches the likeliest
tokens no sample took after a node until those taken cover a mass of the model's probability, read from a pass of
the engine over the node's path (`Engine.score`) where it scores, else from the alternatives its samples recorded;
`force` puts text after a node. Both run their branches as jobs of the same growth, continued by its sampler.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from exlnb.engines.base import EosReason
from exlnb.engines.checks import SEED_MAX
from exlnb.engines.formats import model_bits, model_format
from exlnb.engines.job_options import JobOptions
from exlnb.engines.registry import engine_spec
from exlnb.engines.sampling import SamplerSettings
from exlnb.sample_tree import Provenance, SampleTree, TreeBuilder
from exlnb.session.submitting import Submitting, takes_job_options
from exlnb.streaming import Delivered, JobError, JobStream

MAX_TREE_SAMPLES = 1024  # samples one call draws: past this a tree is a table, and the engine's queue is long
MAX_BRANCHES = 32  # branches one expansion runs: covering 0.99 of a flat distribution could take thousands
TREE_ALTERNATIVES = 5  # the likeliest next tokens each node records, by default
SCORED_CANDIDATES = 256  # the tokens an expansion considers, likeliest first, from a scored distribution
STOPPED = EosReason.STOP_TOKEN.words  # a sample that ended on a stop token: nothing comes after it

Listener = Callable[[], None]


def sampler_words(sampler: SamplerSettings) -> str:
    """The settings in a line: "greedy", or those changed from exllamav2's defaults."""
    if sampler.is_greedy:
        return "greedy"
    changed = sampler.changed()
    return ", ".join(f"{name} {value}" for name, value in changed.items()) or "exllamav2's default sampler"


@dataclass(frozen=True)
class Given:
    """A token a job is given rather than draws: forced text, or an alternative an expansion branches."""

    token: int
    text: str
    probability: float | None  # the model's, where the engine scored it


class TreeGrowth:
    """A sample tree as it grows: its jobs' tokens merged as they arrive. `tree()` is the tree so far."""

    def __init__(self, session: Exploring, prompt_ids: Sequence[int], options: JobOptions) -> None:
        self.session = session
        self.loaded = session.options
        self.prompt_ids = tuple(prompt_ids)
        self.options = options
        self.scores = engine_spec(self.loaded.engine).can("scoring")
        self.provenance = Provenance(
            model=self.loaded.model_dir.name,
            format="url" if self.loaded.url else model_format(self.loaded.model_dir),
            bits=None if self.loaded.url else model_bits(self.loaded.model_dir),
            engine=self.loaded.engine,
            sampler=sampler_words(options.sampler),
            seed=options.seed,
        )
        self._builder = TreeBuilder(prompt_ids, options.max_new_tokens, self.provenance)
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._running = 0  # launches whose jobs have not all ended
        self._settled = threading.Condition(self._lock)
        self._streams: list[JobStream] = []
        self._started = 0  # samples started, drawn or not: the next one's seed is seed + this
        self._said: dict[int, str] = {}  # the last word of an expansion that fell short, by node
        self.last_words = ""  # what the last expansion or forcing did, in a line
        self.errors: list[JobError] = []
        self.notes = self._notes()

    def _notes(self) -> list[str]:
        notes = []
        if not self.options.top_tokens:
            notes.append("no probabilities: the samples recorded none (tokens=0); give tokens=5 to see them")
        if not self.scores:
            notes.append(
                f"the {self.loaded.engine} engine returns no logits: an expansion reads the {self.options.top_tokens} "
                "alternatives its samples recorded, and forced tokens show no probability"
            )
        return notes

    # -- what it holds -----------------------------------------------------------------------------------------

    def tree(self) -> SampleTree:
        """The tree as it stands now."""
        with self._lock:
            return self._builder.freeze([*self.notes, *self._said.values()], grower=self)

    def listen(self, listener: Listener) -> None:
        """Call `listener()` (on a growth thread) after every merge from now on."""
        with self._lock:
            self._listeners.append(listener)

    def forget(self, listener: Listener) -> None:
        """Stop calling `listener` (a view that closed)."""
        with self._lock:
            self._listeners = [other for other in self._listeners if other != listener]

    @property
    def done(self) -> bool:
        with self._lock:
            return self._running == 0

    def wait(self, timeout: float | None = None) -> SampleTree:
        """Block until every job of the growth has ended; the tree, or the error of a sample that failed."""
        with self._settled:
            if not self._settled.wait_for(lambda: self._running == 0, timeout):
                raise TimeoutError(f"the tree is still growing after {timeout} s")
        if self.errors:
            raise self.errors[0]
        return self.tree()

    def cancel(self) -> None:
        """Ask every job still running to stop, without waiting for the engine's step."""
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.request_cancel()

    # -- growing -----------------------------------------------------------------------------------------------

    def sample(self, n: int) -> threading.Event:
        """Start `n` more drawn samples from the prompt; the event is set when they have all ended."""
        return self._launch(0, [()] * n, drawn=True, how="sampled")

    def expand(self, node: int, mass: float = 0.9) -> SampleTree:
        """Branch the model's likeliest tokens after `node` that no sample took, each continued by the sampler,
        until the tokens taken there cover `mass` of the model's probability; the tree after it."""
        if isinstance(mass, bool) or not isinstance(mass, (int, float)) or not 0 < mass <= 1:
            raise ValueError(
                f"mass={mass!r}: give the share of the model's probability to cover, above 0 and at most 1 "
                "(0.9 covers 90%)"
            )
        self._check_grows(node, 1)
        candidates, tree = self._next_tokens(node), self.tree()
        taken = {tree.nodes[child].token_id: tree.nodes[child] for child in tree.nodes[node].children}
        probability = dict(candidates)
        covered = sum(probability.get(token, child.model_probability or 0.0) for token, child in taken.items())
        picks = []
        for token, p in candidates:
            if covered >= mass or len(picks) == MAX_BRANCHES:
                break
            if token not in taken:
                picks.append(Given(token, self.session.tokenizer.decode([token], special=True), p))
                covered += p
        with self._lock:
            self._said.pop(node, None)
            if covered < mass:
                self._said[node] = self._short_of(node, mass, covered, len(picks))
        self.last_words = (
            f"node {node}: {len(picks)} branches; the tokens taken after it cover {covered:.3f} of mass {mass:g}"
            if picks
            else f"node {node}: the tokens taken after it already cover {covered:.3f} of mass {mass:g}"
        )
        self._launch(node, [(pick,) for pick in picks], drawn=False, how="expanded").wait()
        return self._result()

    def _short_of(self, node: int, mass: float, covered: float, branches: int) -> str:
        if branches == MAX_BRANCHES:
            why = f"one expansion runs at most {MAX_BRANCHES} branches: expand it again"
        elif self.scores:
            why = f"the {SCORED_CANDIDATES} likeliest tokens hold no more"
        else:
            why = f"its samples recorded only {self.options.top_tokens} alternatives"
        return f"node {node}: the tokens taken after it cover {covered:.3f}, short of mass {mass:g} ({why})"

    def force(self, node: int, text: str) -> SampleTree:
        """`text` after `node` (one token or several), then on with the sampler; the tree after it."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"text={text!r}: give the text to force after the node, at least one character")
        tokens = self.session.tokenizer.encode(text, special=True)
        self._check_grows(node, len(tokens))
        probabilities = self._probabilities(node, tokens)
        given = tuple(
            Given(t, self.session.tokenizer.decode([t], special=True), p) for t, p in zip(tokens, probabilities)
        )
        self.last_words = f"node {node}: {text!r} forced after it ({len(tokens)} tokens)"
        self._launch(node, [given], drawn=False, how="forced").wait()
        return self._result()

    def _result(self) -> SampleTree:
        if self.errors:
            raise self.errors[-1]
        return self.tree()

    def _check_grows(self, node: int, tokens: int) -> None:
        """Refuse, in one line, to grow after `node` where nothing can follow it."""
        if self.session.options != self.loaded:
            now = "nothing" if self.session.options is None else self.session.options.model_dir.name
            raise ValueError(
                f"this tree grew on {self.loaded.model_dir.name} ({self.loaded.engine}), but {now} is loaded now: "
                "load that model again to grow it"
            )
        if self.session.engine.branch_refusal is not None:  # an expansion or a forcing is a branch at the node
            raise ValueError(self.session.engine.branch_refusal)
        at = self.tree().node(node)
        if STOPPED in at.ended:
            raise ValueError(f"node {node} is a stop token: its samples ended there; grow the node before it")
        left = self.options.max_new_tokens - (at.depth + 1)
        if tokens > left:
            raise ValueError(
                f"node {node} leaves {left} of the answer's {self.options.max_new_tokens} tokens (max_new_tokens) "
                f"and this needs {tokens}: grow an earlier node, or a tree with a larger max_new_tokens"
            )

    def _next_tokens(self, node: int) -> list[tuple[int, float]]:
        """The model's likeliest tokens after `node`, likeliest first: scored by the engine where it scores,
        else the alternatives its samples recorded there."""
        if not self.scores:
            return [(token, p) for token, _text, p in self.tree().node(node).alternatives]
        with self._lock:
            ids = [*self.prompt_ids, *self._builder.path(node)]

        def likeliest(engine) -> list[tuple[int, float]]:
            top = engine.score(ids)[-1].softmax(-1).topk(SCORED_CANDIDATES)
            return list(zip(top.indices.tolist(), top.values.tolist()))

        return self.session.run_on_engine(likeliest)

    def _probabilities(self, node: int, tokens: Sequence[int]) -> list[float | None]:
        """The model's probability of each of `tokens` after `node`, where the engine scores."""
        if not self.scores:
            return [None] * len(tokens)
        with self._lock:
            before = [*self.prompt_ids, *self._builder.path(node)]

        def scored(engine) -> list[float]:
            rows = engine.score([*before, *tokens])[len(before) - 1 : -1].softmax(-1)
            return [float(rows[i, t]) for i, t in enumerate(tokens)]

        return self.session.run_on_engine(scored)

    def _launch(self, start: int, leads: Sequence[tuple[Given, ...]], *, drawn: bool, how: str) -> threading.Event:
        """One job per lead from node `start`: its given tokens merged at once, then what it draws as it comes;
        the event is set when every job has ended."""
        ended = threading.Event()
        jobs = []
        with self._lock:
            for lead in leads:
                seed = None if self.options.seed is None else (self.options.seed + self._started) % (SEED_MAX + 1)
                self._started += 1
                provenance = replace(self.provenance, seed=seed, how=how)
                self._builder.enter(start, drawn)
                at = start
                for given in lead:
                    at = self._builder.step(
                        at,
                        given.token,
                        given.text,
                        drawn=drawn,
                        provenance=provenance,
                        probability=given.probability,
                        given=True,
                    )
                done = self._builder.depth(at) + 1
                left = self.options.max_new_tokens - done
                if left < 1:
                    self._builder.end(at, EosReason.MAX_NEW_TOKENS.words)
                    continue
                options = replace(
                    self.options,
                    max_new_tokens=left,
                    min_new_tokens=min(left, max(0, self.options.min_new_tokens - done)),
                    seed=seed,
                )
                jobs.append(
                    (self.session.spec_for([*self.prompt_ids, *self._builder.path(at)], options), at, provenance)
                )
            if jobs:
                self._running += 1
        if not jobs:
            ended.set()
            self._tell()
            return ended
        shared: queue.SimpleQueue[Delivered] = queue.SimpleQueue()
        try:
            streams = self.session.submit_together([spec for spec, _, _ in jobs], shared=shared)
        except BaseException:
            self._settle(ended)
            raise
        with self._lock:
            self._streams += streams
        cursors = {stream.job_id: [stream, at, provenance] for stream, (_, at, provenance) in zip(streams, jobs)}
        thread = threading.Thread(target=self._consume, args=(shared, cursors, drawn, ended), daemon=True)
        thread.name = "exlnb-tree"
        thread.start()
        return ended

    def _consume(self, shared: queue.SimpleQueue[Delivered], cursors: dict, drawn: bool, ended: threading.Event):
        """Merge each job's tokens into the tree as its events arrive, until every job has ended."""
        running = len(cursors)
        tokenizer = self.session.tokenizer
        try:
            while running:
                item = shared.get()
                cursor = cursors[item.job_id]
                stream, at, provenance = cursor
                try:
                    event = stream.receive(item)
                except JobError as error:
                    self.errors.append(error)
                    running -= 1
                    continue
                infos = event.token_info or [None] * len(event.token_ids)
                with self._lock:
                    for token, info in zip(event.token_ids, infos):
                        text = info.text if info else tokenizer.decode([token], special=True)
                        at = self._builder.step(at, token, text, drawn=drawn, provenance=provenance, info=info)
                    if event.eos:
                        self._builder.end(at, event.eos_reason.words if event.eos_reason else "ended")
                cursor[1] = at
                running -= event.eos
                self._tell()
        finally:
            self._settle(ended)

    def _settle(self, ended: threading.Event) -> None:
        with self._settled:
            self._running -= 1
            self._settled.notify_all()
        ended.set()
        self._tell()

    def _tell(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


class Exploring(Submitting):
    """Trees of samples: `grow_tree` to watch one grow, `tree` to wait for it."""

    @takes_job_options
    def grow_tree(
        self, prompt: str | Sequence[int], n: int = 16, *, top_tokens: int = TREE_ALTERNATIVES, **options
    ) -> TreeGrowth:
        """Start `n` samples of `prompt` (text as the model gets it, special tokens encoded as such, or token ids),
        merged into one tree as they stream; `options` are `JobOptions`' (`max_new_tokens`, `seed`: sample i uses
        seed + i, ...) and sampler settings such as `temperature=1.0`; each node records `top_tokens`
        alternatives."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_TREE_SAMPLES:
            raise ValueError(
                f"n={n!r}: a tree draws 1 to {MAX_TREE_SAMPLES} samples at a time (grow it further with "
                "tree.expand, or draw another tree)"
            )
        job = JobOptions.build(top_tokens=top_tokens, **options)
        if job.seed is not None and job.seed > SEED_MAX - (n - 1):
            raise ValueError(f"seed={job.seed} is out of range: use 0 to {SEED_MAX - (n - 1)} (sample i uses seed + i)")
        growth = TreeGrowth(self, self.prompt_ids(prompt), job)
        growth.sample(n)
        return growth

    @takes_job_options
    def tree(
        self, prompt: str | Sequence[int], n: int = 16, *, top_tokens: int = TREE_ALTERNATIVES, **options
    ) -> SampleTree:
        """`grow_tree(...)` and wait for the whole tree (docs/tree.md)."""
        return self.grow_tree(prompt, n, top_tokens=top_tokens, **options).wait()
