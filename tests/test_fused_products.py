"""Fused fp16 projections (engines/fused_products.py) on both GPU engines, over a small random Llama whose q, k and
v are one shape (as Llama-2-7B's): each projection gives what its own product gives, the model's logits stay those
of the separate products, no weight is held twice, and the switch turns it off. The single-row products on exlnb's
GEMV over one layer of Llama-2-7B's widths, whose weights exceed exllamav3's 16 MiB slabs (the weights of its
small models are carved from slabs and stay on cuBLAS). On the CPU: a group's and a single-row product's mechanics
over stand-in projections. The GPU suite's other tests run the bundled model with the products fused, as the
engines load by default."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from benchmarks.paged_acceptance import QUESTIONS
from exlnb.engines.cuda_graphs import CHECK_TOLERANCE, beyond_tolerance, relative_difference
from exlnb.engines.fused_products import (
    MLP_TAILS,
    FusedProducts,
    ProductGroup,
    RowProduct,
    TailKind,
    check_fused,
    check_tails,
    stack_without_copy,
)
from exlnb.random_model import LLAMA_7B, random_llama
from exlnb.session import Session
from exlnb.templates import chatml

LAYERS = 3
# an intermediate width of 768: exllamav3 pads 704 to 768, and a padded projection is rightly not fused
SHAPE = dict(LLAMA_7B, hidden_size=256, intermediate_size=768, num_hidden_layers=LAYERS, num_attention_heads=4)
ENGINES = ("exllamav2", "exllamav3")
WIDE = dict(LLAMA_7B, num_hidden_layers=1)  # o: 32 MiB, down: 86 MiB, each an allocation of its own


@pytest.fixture(scope="module")
def folder():
    if not torch.cuda.is_available():
        pytest.skip("the fused products run on CUDA")
    with random_llama(dict(SHAPE, num_key_value_heads=4)) as (path, _):
        yield path


@pytest.fixture(scope="module")
def wide_folder():
    if not torch.cuda.is_available():
        pytest.skip("the single-row products run on CUDA")
    with random_llama(WIDE) as (path, _):
        yield path


def load(folder, engine: str, **options) -> Session:
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed")
    session = Session()
    session.load(str(folder), engine=engine, progress=False, **options)
    return session


@pytest.fixture(scope="module", params=ENGINES)
def session(folder, request):
    loaded = load(folder, request.param)
    yield loaded
    loaded.unload()


@pytest.mark.gpu
def test_the_status_says_how_many_groups_are_fused(session):
    sizes = session.run_on_engine(lambda engine: [len(group.linears) for group in engine.fused.groups])
    assert sizes == [3, 2] * LAYERS  # each layer's q, k and v, then its gate and up
    assert f"{2 * LAYERS} fp16 projection groups fused" in session.status().decode
    assert not any("not fused" in note for note in session.status().notes)


def handover() -> tuple[int, torch.cuda.Event]:
    """On the engine thread, after the work a test reads on its own thread: that thread's current stream and an event
    recorded there. Two tests read values that a read just after them no longer found, only with three suites'
    processes on one card; `handover_note` says what such a read would need to be understood."""
    ended = torch.cuda.Event()
    ended.record()
    return torch.cuda.current_stream().cuda_stream, ended


def handover_note(mark: tuple[int, torch.cuda.Event], finished: bool) -> str:
    """`finished`: whether the event had completed when the test began its first read (query it before reading)."""
    return (
        f"the engine thread's stream {mark[0]:#x}, this thread's {torch.cuda.current_stream().cuda_stream:#x}; the "
        f"engine's work {'had' if finished else 'had not'} finished at the first read"
    )


@pytest.mark.gpu
def test_each_projection_gives_its_own_product_and_another_input_takes_the_separate_path(session):
    def check(engine):
        group = engine.fused.groups[-1]  # the last layer's gate and up (float32 outputs in exllamav3's Llama)
        params = () if engine.name == "exllamav2" else ({},)  # exllamav3's projections take the step's params
        x = torch.randn((3, 1, group.stacked.shape[1]), dtype=torch.half, device=group.stacked.device)
        with torch.inference_mode():
            fused = [linear.forward(x, *params) for linear in group.linears]
            separate = [own(x, *params) for own in group._own]
            alone = group.linears[-1].forward(x.clone(), *params)
        return fused, separate, alone, group._pending, group.one_matrix, handover()

    fused, separate, alone, pending, one_matrix, mark = session.run_on_engine(check)
    finished = mark[1].query()
    assert pending is None  # nothing held once the group's last output is handed over
    for mine, theirs in zip(fused, separate, strict=True):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        assert mine.is_contiguous() is not one_matrix  # read as one matrix (the MLP's fold): strided slices of it
        error = relative_difference(mine.float(), theirs.float())
        if error >= 1e-3:  # in two suites beside two others' processes: 1.4e10 and 5.9e9, then 0.0 read again
            torch.cuda.synchronize()
            again = relative_difference(mine.float(), theirs.float())
            assert error < 1e-3, f"{error} (read again after a synchronize: {again}; {handover_note(mark, finished)})"
    assert torch.equal(alone, separate[-1])  # not the input the group just read: the projection's own product


@pytest.mark.gpu
def test_the_logits_stay_those_of_the_separate_products(session):
    token_ids = session.run_on_engine(lambda engine: engine.tokenizer.encode(chatml(QUESTIONS[0])))

    def both(engine):
        fused = engine.score(token_ids)
        with engine.fused.paused():
            return fused, engine.score(token_ids)

    fused, separate = session.run_on_engine(both)
    error = float((fused - separate).abs().max() / separate.abs().max())
    assert error < CHECK_TOLERANCE, error  # as close as a graph's replay must be to the eager step


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model", ["folder", "wide_folder"])
def test_no_weight_is_held_twice_and_the_switch_keeps_the_separate_products(model, engine, monkeypatch, request):
    """On the wide model too, whose grouped weights exllamav3 allocates one by one: stacked, they must be let go
    (a 7B-shaped model held them twice, 8.4 GiB, H200, 2026-11-28), and so must the o and down weights laid out
    again for the GEMV."""
    folder = request.getfixturevalue(model)

    def loaded_bytes() -> tuple[int, Session]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        session = load(folder, engine, graphs="off")
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, session

    fused_bytes, fused = loaded_bytes()
    largest = fused.run_on_engine(lambda e: max(g.stacked.numel() * g.stacked.element_size() for g in e.fused.groups))
    fused.unload()
    monkeypatch.setenv("EXLNB_FUSED_PRODUCTS", "0")
    apart_bytes, apart = loaded_bytes()
    try:
        assert apart.run_on_engine(lambda e: e.fused.groups) == []
        assert "fused" not in apart.status().decode
    finally:
        apart.unload()
    assert fused_bytes <= apart_bytes + largest, (fused_bytes, apart_bytes, largest)  # moved, never copied


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ENGINES)
def test_single_rows_of_o_down_and_the_head_take_the_gemv_and_give_the_separate_product(wide_folder, engine):
    session = load(wide_folder, engine)
    try:

        def check(engine):
            rows = engine.fused.rows
            params = () if engine.name == "exllamav2" else ({},)
            results = []
            with torch.inference_mode():
                for row in rows:
                    x = torch.randn((1, 1, row.weight.shape[1]), dtype=torch.half, device=row.weight.device)
                    many = torch.randn((3, 1, row.weight.shape[1]), dtype=torch.half, device=row.weight.device)
                    single, apart = row.linear.forward(x, *params), row.separate(x, *params)
                    results.append((single, apart, row.linear.forward(many, *params), row.separate(many, *params)))
            return len(rows), results

        count, results = session.run_on_engine(check)
        assert count == 3  # the layer's o and down, and the head
        assert "3 single-row products on exlnb's GEMV" in session.status().decode
        assert not any("not fused" in note for note in session.status().notes)
        for single, apart, many, many_apart in results:
            assert single.shape == apart.shape and single.dtype == apart.dtype
            assert float((single.float() - apart.float()).abs().max() / apart.float().abs().max()) < 1e-3
            assert torch.equal(many, many_apart)  # more than one row: the separate product itself
    finally:
        session.unload()


class _Projection:
    """A stand-in for a library's fp16 projection on the CPU: its weight input-major, its forward the product."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.calls = weight, 0

    def forward(self, x: torch.Tensor, loras=None) -> torch.Tensor:
        self.calls += 1
        return x.to(self.weight.dtype) @ self.weight


def _group(count: int = 3) -> tuple[list[_Projection], ProductGroup]:
    torch.manual_seed(0)
    projections = [_Projection(torch.randn(16, 8)) for _ in range(count)]
    stacked = torch.stack([p.weight for p in projections])
    group = ProductGroup(projections, stacked, torch.float32, lambda args, kwargs: not kwargs.get("loras"))
    return projections, group


def test_a_group_computes_every_output_at_its_first_projection_and_hands_the_rest_over():
    projections, group = _group()
    fused = FusedProducts([group])
    x, other = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    outputs = [p.forward(x) for p in projections]
    for p, y in zip(projections, outputs, strict=True):
        assert y.shape == (2, 1, 8) and y.is_contiguous()
        assert torch.allclose(y, x @ p.weight, atol=1e-5)
    assert [p.calls for p in projections] == [0, 0, 0] and group._pending is None
    assert torch.allclose(projections[1].forward(other), other @ projections[1].weight)
    assert projections[1].calls == 1  # another input: the projection's own product
    projections[0].forward(x, loras=["a LoRA"])
    assert projections[0].calls == 1  # options the batched product does not cover: its own product
    projections[0].forward(x.double())
    assert projections[0].calls == 2 and group._pending is None  # an input of another type: its own product too
    with fused.paused():
        projections[2].forward(x)
        assert projections[2].calls == 1
    fused.uninstall()
    projections[0].forward(x)
    assert projections[0].calls == 3 and fused.describe() == ""


def test_fused_logits_that_differ_from_the_separate_ones_are_refused_in_one_line():
    projections, group = _group(2)
    fused = FusedProducts([group])

    def rows(token_ids: list[int]) -> torch.Tensor:
        return torch.tensor(token_ids, dtype=torch.float32).repeat(16, 1).t().unsqueeze(1)

    def agreeing(token_ids: list[int]) -> torch.Tensor:
        return projections[0].forward(rows(token_ids))

    def off_by_one_when_fused(token_ids: list[int]) -> torch.Tensor:
        return agreeing(token_ids) + ("forward" in vars(projections[0]))  # the fused path wrong, on purpose

    assert check_fused(fused, agreeing, [1, 2, 3]) is None
    reason = check_fused(fused, off_by_one_when_fused, [1, 2, 3])
    assert reason is not None and "differ from the separate ones" in reason and "\n" not in reason
    assert "forward" in vars(projections[0])  # the check leaves the groups as they were; the engine uninstalls


def test_a_group_that_cannot_be_made_leaves_every_projection_with_its_own_forward():
    projections, group = _group()

    def groups():
        yield group
        raise RuntimeError("a projection the fusion misread")

    with pytest.raises(RuntimeError, match="misread"):
        FusedProducts(groups())
    assert not any("forward" in vars(p) for p in projections)


def test_weights_in_one_allocation_stack_as_a_view_and_weights_of_their_own_as_a_stack():
    """No weight held twice: exllamav3's loader carves small weights from shared slab blocks, where a stack would
    leave the block alive beside it (a GPU run found every grouped weight of a small model held twice)."""
    block = torch.randn(600)
    evenly = [block[i * 136 : i * 136 + 128].view(16, 8) for i in range(3)]  # gaps between them, as alignment leaves
    view, slots = stack_without_copy(evenly)
    assert slots == [0, 1, 2] and view.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
    for weight, stacked in zip(evenly, view.unbind(0), strict=True):
        assert torch.equal(weight, stacked) and stacked.data_ptr() == weight.data_ptr()
    x = torch.randn(3, 5, 16)
    assert torch.allclose(torch.bmm(x, view), torch.stack([x[i] @ w for i, w in enumerate(evenly)]), atol=1e-5)
    transposed, _ = stack_without_copy([w.t() for w in evenly])  # exllamav2's (out, in) weights, read input-major
    assert torch.equal(transposed[1], evenly[1].t())
    # exllamav3 loads up before gate: the view follows the allocation, the slots say where each weight lies
    gate, up = block[128:256].view(16, 8), block[0:128].view(16, 8)
    view, slots = stack_without_copy([gate, up])
    assert slots == [1, 0]
    assert view[slots[0]].data_ptr() == gate.data_ptr() and view[slots[1]].data_ptr() == up.data_ptr()

    own = [torch.randn(16, 8) for _ in range(2)]
    stacked, slots = stack_without_copy(own)
    assert slots == [0, 1] and stacked.is_contiguous() and torch.equal(stacked[1], own[1])

    uneven = [block[0:128].view(16, 8), block[128:256].view(16, 8), block[300:428].view(16, 8)]
    overlapping = [block[0:128].view(16, 8), block[64:192].view(16, 8)]
    sliced_apart = [block[0:128].view(16, 8), torch.randn(200)[8:136].view(16, 8)]  # each a slice of another block
    shapes = [torch.randn(16, 8), torch.randn(8, 16)]
    for weights in (uneven, overlapping, sliced_apart, shapes):
        assert stack_without_copy(weights) is None


def test_a_group_stacked_out_of_order_hands_each_projection_its_own_output():
    block = torch.randn(256)
    gate, up = _Projection(block[128:256].view(16, 8)), _Projection(block[0:128].view(16, 8))
    stacked, slots = stack_without_copy([gate.weight, up.weight])
    group = ProductGroup([gate, up], stacked, torch.float32, lambda args, kwargs: True, slots)
    FusedProducts([group])
    x = torch.randn(2, 1, 16)
    assert torch.allclose(gate.forward(x), x @ gate.weight, atol=1e-5)
    assert torch.allclose(up.forward(x), x @ up.weight, atol=1e-5) and gate.calls == up.calls == 0


def test_a_group_left_separate_is_counted_and_said():
    projections, group = _group()
    fused = FusedProducts(iter([group, None, None]))
    assert fused.groups == [group] and fused.left_separate == 2
    assert fused.describe() == "1 fp16 projection groups fused, 2 left separate (weights in a shared allocation)"


def _row_product(single_row) -> tuple[_Projection, RowProduct]:
    torch.manual_seed(0)
    projection = _Projection(torch.randn(16, 8))

    def wanted(args: tuple, kwargs: dict) -> torch.dtype | None:
        return None if kwargs.get("loras") else torch.float32

    return projection, RowProduct(projection, projection.weight.t().contiguous(), wanted, single_row=single_row)


def test_a_single_row_takes_the_gemv_and_every_other_call_the_separate_product():
    rows_seen = []

    def single_row(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        rows_seen.append(x.shape)
        return (x.reshape(1, -1) @ weight.t()).to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    projection, row = _row_product(single_row)
    fused = FusedProducts(rows=iter([row]))
    x = torch.randn(1, 1, 16)
    assert torch.allclose(projection.forward(x), x @ projection.weight, atol=1e-5)
    assert rows_seen == [(1, 1, 16)] and projection.calls == 0
    projection.forward(torch.randn(3, 1, 16))
    projection.forward(x, loras=["a LoRA"])
    projection.forward(x.double())
    assert projection.calls == 3 and len(rows_seen) == 1  # batches, options and other types: the separate product
    with fused.paused():
        projection.forward(x)
    assert projection.calls == 4
    assert fused.describe() == "1 single-row products on exlnb's GEMV"
    fused.uninstall()
    projection.forward(x)
    assert projection.calls == 5 and fused.describe() == ""


def test_a_gemv_that_differs_from_the_separate_product_is_refused_in_one_line():
    def off_by_one(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return (x.reshape(1, -1) @ weight.t() + 1).view(*x.shape[:-1], weight.shape[0])

    def right(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return (x.reshape(1, -1) @ weight.t()).view(*x.shape[:-1], weight.shape[0])

    assert check_fused(FusedProducts(rows=iter([_row_product(right)[1]])), lambda ids: torch.zeros(1), [1]) is None
    reason = check_fused(FusedProducts(rows=iter([_row_product(off_by_one)[1]])), lambda ids: torch.zeros(1), [1])
    assert reason is not None and "exlnb's GEMV differs" in reason and "\n" not in reason


@pytest.mark.gpu
def test_an_mlp_tail_in_its_down_product_gives_the_library_mlp_s_bits(wide_folder, monkeypatch):
    """`EXLNB_MLP_TAIL=1` on Llama-2-7B's widths: a single row's MLP takes the two-kernel tail and gives exactly the
    library's own MLP (SiLU, multiply, clamp, down on exlnb's GEMV, residual add); more rows take the library's."""
    monkeypatch.setenv("EXLNB_MLP_TAIL", "1")
    monkeypatch.setenv("EXLNB_ATTENTION_TAIL", "0")  # this test's tails alone, whatever the suite sets
    monkeypatch.setenv("EXLNB_NORM_IN_PRODUCT", "0")  # the library's bits: no norm folded in
    session = load(wide_folder, "exllamav2")
    try:

        def check(engine):
            results = []
            with torch.inference_mode():
                for tail in engine.fused.tails:
                    for rows in (1, 3):
                        x = torch.randn((rows, 1, tail.hidden), dtype=torch.half, device=tail.down.device)
                        results.append((tail.mlp.forward(x.clone()), type(tail.mlp).forward_torch(tail.mlp, x)))
            return len(engine.fused.tails), results, handover()

        count, results, mark = session.run_on_engine(check)
        finished = mark[1].query()
        assert count == 1 and "1 MLP tails in two kernels" in session.status().decode
        for (tail, own), rows in zip(results, (1, 3), strict=True):
            differing = tail != own
            if differing.any():  # once beside two other suites' processes: all 4,096 differed, by up to 0.0
                torch.cuda.synchronize()
                largest = float((tail.float() - own.float()).abs().max())
                assert not differing.any(), (
                    f"{rows} row(s): {int(differing.sum())} of {own.numel()} outputs differ, "
                    f"{int((tail != own).sum())} read again after a synchronize, by up to {largest}; "
                    f"{handover_note(mark, finished)}"
                )
    finally:
        session.unload()


@pytest.mark.gpu
def test_a_norm_folded_into_gate_and_up_agrees_with_the_library_s_mlp_to_the_load_s_tolerance(wide_folder, monkeypatch):
    """`EXLNB_MLP_TAIL=1 EXLNB_NORM_IN_PRODUCT=1` on Llama-2-7B's widths with no attention tail: gate and up are
    laid out output-major and q, k and v as they were (no tail folds a norm into them), the MLP's tail folds its
    norm into gate and up and says so, its load check keeps it, and a single row's MLP is the
    library's to that tolerance (more rows: the library's own bits)."""
    from exlnb.engines.exllamav2.folded_norm import output_major

    for variable, value in (("EXLNB_MLP_TAIL", "1"), ("EXLNB_NORM_IN_PRODUCT", "1"), ("EXLNB_ATTENTION_TAIL", "0")):
        monkeypatch.setenv(variable, value)
    session = load(wide_folder, "exllamav2")
    try:

        def check(engine):
            (tail,) = engine.fused.tails
            layouts = [output_major(group.stacked) for group in engine.fused.groups]
            results = []
            with torch.inference_mode():
                for rows in (1, 3):
                    x = torch.randn((rows, 1, tail.hidden), dtype=torch.half, device=tail.down.device)
                    results.append((tail.mlp.forward(x.clone()), type(tail.mlp).forward_torch(tail.mlp, x)))
            return layouts, tail.differs(), results

        layouts, error, ((one, one_own), (many, many_own)) = session.run_on_engine(check)
        assert layouts == [False, True]  # q, k and v; gate and up
        assert "1 MLP tails with the norm and the activation in gate and up" in session.status().decode
        assert not any(note.startswith("step tails not used") for note in session.status().notes)
        assert not beyond_tolerance(error) and not beyond_tolerance(relative_difference(one.float(), one_own.float()))
        assert torch.equal(many, many_own)
        assert session.generate("The capital of France is", max_new_tokens=4).result().new_tokens > 0
    finally:
        session.unload()


@pytest.mark.gpu
def test_greedy_tokens_with_the_mlp_tail_are_those_without(monkeypatch):
    """The bundled model on the ExLlamaV2 engine, CUDA graphs on: the same greedy tokens with the tails as without."""
    from exlnb.engines.job_options import JobOptions
    from exlnb.engines.sampling import SamplerSettings

    if not torch.cuda.is_available() or importlib.util.find_spec("exllamav2") is None:
        pytest.skip("the ExLlamaV2 engine needs CUDA and exllamav2")
    options = JobOptions(max_new_tokens=32, sampler=SamplerSettings.greedy(), stop_at_eos=False)
    tokens = {}
    monkeypatch.setenv("EXLNB_ATTENTION_TAIL", "0")  # this test's tails alone, whatever the suite sets
    monkeypatch.setenv("EXLNB_NORM_IN_PRODUCT", "0")  # the library's bits: no norm folded in
    for switch in ("0", "1"):
        monkeypatch.setenv("EXLNB_MLP_TAIL", switch)
        session = load("smollm2-135m-instruct", "exllamav2")
        try:
            tails = session.run_on_engine(lambda engine: len(engine.fused.tails))
            assert (tails > 0) == (switch == "1")
            streams = [session.submit(session.spec_for(chatml(q), options)) for q in QUESTIONS[:3]]
            tokens[switch] = [stream.result().token_ids for stream in streams]
        finally:
            session.unload()
    assert tokens["1"] == tokens["0"]


class StandInTail:
    """A stand-in for a tail of a kind (an MLP's unless told): installed or not, and how far it is from the library's
    step."""

    def __init__(self, error: float, kind: TailKind = MLP_TAILS) -> None:
        self.error, self.kind, self.installed = error, kind, False

    def install(self) -> None:
        self.installed = True

    def uninstall(self) -> None:
        self.installed = False

    def differs(self) -> float:
        return self.error


def test_mlp_tails_are_installed_said_paused_and_refused_in_one_line_where_they_differ():
    tail = StandInTail(0.0)
    fused = FusedProducts(tails=iter([tail]))
    assert tail.installed and fused.describe() == "1 MLP tails in two kernels"
    with fused.paused():
        assert not tail.installed
    assert tail.installed and check_tails(fused) is None
    differing = FusedProducts(tails=iter([StandInTail(0.0), StandInTail(0.5)]))
    reason = check_tails(differing)
    assert reason is not None and "MLP's tail" in reason and "0.5" in reason and "\n" not in reason
    differing.drop_tails()  # what a load does with them, keeping its products
    assert differing.tails == [] and differing.describe() == ""
    fused.uninstall()
    assert not tail.installed and fused.describe() == ""


class _Mlp:
    """A stand-in for exllamav2's unquantized MLP: its `forward` calls `forward_torch` as exllamav2 0.3.2's does."""

    def __init__(self, hidden: int, inner: int) -> None:
        torch.manual_seed(0)
        self.pre_layernorm = SimpleNamespace(forward=lambda x: x * 0.5)
        self.gate_proj, self.up_proj = _Projection(torch.randn(hidden, inner)), _Projection(torch.randn(hidden, inner))
        self.down_proj = SimpleNamespace(
            linear=SimpleNamespace(weight=SimpleNamespace(data=torch.randn(hidden, inner)))
        )
        self.own_calls = 0

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None, intermediates=False, loras=None):
        return self.forward_torch(hidden_states, cache, attn_params, past_len, intermediates, loras=loras)

    def forward_torch(self, hidden_states, cache=None, attn_params=None, past_len=None, intermediates=False, **kw):
        self.own_calls += 1
        post_norm = self.pre_layernorm.forward(hidden_states)
        y = torch.nn.functional.silu(self.gate_proj.forward(post_norm)) * self.up_proj.forward(post_norm)
        return y @ self.down_proj.linear.weight.data.t() + hidden_states


def test_an_mlp_tail_takes_single_rows_and_leaves_every_other_call_to_the_library(monkeypatch):
    """The kernels (here stand-ins for exlnb's, which need triton) for one row; the library's own MLP for more
    rows, LoRAs, intermediates, and after the tails are uninstalled."""
    from exlnb.engines.exllamav2.mlp_tail import MlpTail

    rows_in_kernel = []

    def silu_times(gate, up):
        rows_in_kernel.append(gate.shape)
        return torch.nn.functional.silu(gate) * up

    def row_times_matrix_plus(x, weight, residual):
        return residual + x @ weight.t()

    monkeypatch.setitem(sys.modules, "exlnb.engines.gated_activation", SimpleNamespace(silu_times=silu_times))
    monkeypatch.setitem(sys.modules, "exlnb.engines.gemv", SimpleNamespace(row_times_matrix_plus=row_times_matrix_plus))
    mlp = _Mlp(hidden=8, inner=24)
    fused = FusedProducts(tails=iter([MlpTail(mlp)]))
    one = torch.randn(1, 1, 8)
    expected = type(mlp).forward_torch(mlp, one)
    mlp.own_calls = 0

    assert torch.allclose(mlp.forward(one), expected, atol=1e-5)
    assert rows_in_kernel == [(1, 1, 24)] and mlp.own_calls == 0
    mlp.forward(torch.randn(3, 1, 8))
    mlp.forward(one, loras=["a LoRA"])
    mlp.forward(one, intermediates=True)
    assert mlp.own_calls == 3 and len(rows_in_kernel) == 1
    assert fused.describe() == "1 MLP tails in two kernels"
    fused.uninstall()
    mlp.forward(one)
    assert mlp.own_calls == 4 and len(rows_in_kernel) == 1


def test_a_folded_norm_runs_inside_gate_and_up_and_the_tail_gives_the_library_s_mlp(monkeypatch):
    """`EXLNB_NORM_IN_PRODUCT=1`: a single row goes to the gate and up stack with its norm and activation in one
    launch (here a stand-in for normed_gemv's kernel computing the stand-in norm, the products and the activation as
    they compute them), in the stack's slots, then the down product; the norm's own forward and the activation's
    kernel are not called; the output is the library's; the status names the fold."""
    from exlnb.engines.exllamav2.folded_norm import FoldedNorm
    from exlnb.engines.exllamav2.mlp_tail import MlpTail

    stacks = []

    def normed_gated_row(x, weight, eps, stack, slots):
        stacks.append((stack, slots))
        rows = (x.reshape(1, 1, -1) * 0.5).expand(stack.shape[0], -1, -1)  # the stand-in norm, as _Mlp's
        products = torch.bmm(rows, stack).view(stack.shape[0], -1)
        return F.silu(products[slots[0]]) * products[slots[1]]

    activations = []
    monkeypatch.setitem(sys.modules, "exlnb.engines.normed_gemv", SimpleNamespace(normed_gated_row=normed_gated_row))
    monkeypatch.setitem(
        sys.modules,
        "exlnb.engines.gated_activation",
        SimpleNamespace(silu_times=lambda g, u: activations.append(g.shape) or F.silu(g) * u),
    )
    monkeypatch.setitem(sys.modules, "exlnb.engines.gemv", SimpleNamespace(row_times_matrix_plus=_plus))
    mlp = _Mlp(hidden=8, inner=24)
    stack = torch.stack([mlp.up_proj.weight, mlp.gate_proj.weight])  # up first: the slots say where each lies
    tail = MlpTail(mlp, FoldedNorm(stack, (1, 0), torch.ones(8), 1e-5))
    fused = FusedProducts(tails=iter([tail]))
    norms = []
    norm = mlp.pre_layernorm.forward
    mlp.pre_layernorm = SimpleNamespace(forward=lambda x: norms.append(x.shape) or norm(x))
    one = torch.randn(1, 1, 8)
    expected = type(mlp).forward_torch(mlp, one)
    norms.clear()

    got = mlp.forward(one)

    assert torch.allclose(got, expected, atol=1e-5) and got.shape == one.shape
    assert norms == [] and activations == [] and stacks == [(stack, (1, 0))]
    assert fused.describe() == "1 MLP tails with the norm and the activation in gate and up"
    mlp.forward(torch.randn(3, 1, 8))
    assert len(norms) == 1 and len(stacks) == 1  # a batch takes the library's norm and products


def _plus(x, weight, residual):
    """exlnb's GEMV with the residual, as a stand-in: x @ weight.T + residual in the residual's shape."""
    return residual + (x.reshape(1, -1) @ weight.t()).view(residual.shape)


def test_an_exllamav2_group_laid_out_output_major_keeps_each_weight_as_it_lay():
    """For a folded norm the ExLlamaV2 engine stacks a group's (out, in) weights as they lie: each projection's
    weight is then its slice of the stack, contiguous as before, the group's (n, in, out) stack its transposed view,
    and the batched product is each projection's."""
    from exlnb.engines.exllamav2.folded_norm import ATTENTION, output_major
    from exlnb.engines.exllamav2.fused_products import _group

    torch.manual_seed(0)
    weights = [torch.randn(24, 8) for _ in range(2)]  # (out, in), as an nn.Linear holds them
    linears = [
        SimpleNamespace(linear=SimpleNamespace(weight=torch.nn.Parameter(w.clone(), requires_grad=False)))
        for w in weights
    ]
    group = _group(linears, ATTENTION)
    assert group.stacked.shape == (2, 8, 24) and output_major(group.stacked) and not group.one_matrix
    for linear, weight, slot in zip(linears, weights, group.slots, strict=True):
        assert linear.linear.weight.is_contiguous() and torch.equal(linear.linear.weight, weight)
        assert linear.linear.weight.data_ptr() == group.stacked[slot].data_ptr()
    x = torch.randn(3, 8)
    products = torch.bmm(x.expand(2, -1, -1), group.stacked)
    for product, weight in zip(products, weights, strict=True):
        torch.testing.assert_close(product, x @ weight.t())

    apart = [SimpleNamespace(linear=SimpleNamespace(weight=torch.nn.Parameter(w.clone()))) for w in weights]
    input_major = _group(apart, None)
    assert input_major.stacked.is_contiguous() and not output_major(input_major.stacked)
    assert torch.equal(apart[1].linear.weight, weights[1])  # the same values, now a transposed view of the stack


class _OutputMajorProjection:
    """A stand-in for an exllamav2 fp16 projection: its (out, in) weight in `linear.weight`, its own product."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.linear = SimpleNamespace(weight=torch.nn.Parameter(weight, requires_grad=False))
        self.calls = 0

    def forward(self, x: torch.Tensor, loras=None) -> torch.Tensor:
        self.calls += 1
        return x @ self.linear.weight.t()


def test_gate_and_up_laid_out_for_a_folded_norm_are_read_as_one_matrix_and_hand_over_strided_outputs():
    """Where the MLP's norm folds into gate and up, the ExLlamaV2 engine reads them for prompts and batches as one
    (2 * out, in) matrix, as an nn.Linear reads a fused projection (batched over their transposed stack, batch 8 was
    slower): each projection's output is its product, a strided slice of the one product, and the projections run
    none of their own; q, k and v so laid out stay batched, each output contiguous, as exllamav2's RoPE reads them."""
    from exlnb.engines.exllamav2.folded_norm import ATTENTION, MLP
    from exlnb.engines.exllamav2.fused_products import _group

    torch.manual_seed(1)
    weights = [torch.randn(24, 8).half() for _ in range(2)]  # gate's and up's (out, in), fp16 as the engine's
    x = torch.randn(3, 2, 8).half()  # a batch of three, two positions each
    for folding, strided in ((MLP, True), (ATTENTION, False)):
        projections = [_OutputMajorProjection(w.clone()) for w in weights]
        group = _group(projections, folding)
        assert group.one_matrix is strided
        FusedProducts([group])
        gate, up = (projection.forward(x) for projection in projections)
        for output, weight in zip((gate, up), weights, strict=True):
            assert output.shape == (3, 2, 24) and output.is_contiguous() is not strided
            torch.testing.assert_close(output.float(), x.float() @ weight.float().t(), rtol=2e-3, atol=2e-3)
        if strided:
            assert up.data_ptr() - gate.data_ptr() == 24 * gate.element_size()  # side by side in one product
        assert [projection.calls for projection in projections] == [0, 0] and group._pending is None
