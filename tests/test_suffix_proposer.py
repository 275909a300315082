"""The model-free suffix drafter behind the engine's `Proposer` interface
(engine/proposers/suffix.py, issue 44): greedy output stays mlx-lm's while its drafts are
kept on text that repeats itself, sampled rows run with q a point mass (the statistics of
that are test_proposer's point-mass test), and the config refuses what it cannot run."""

import dataclasses
import json

import pytest
from engine_helpers import loaded, prompt_of, reference_greedy

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.proposers.suffix import SuffixProposer
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams

N = 24  # tokens per request


def _run(eng, reqs, join_at):
    """Decode `reqs`, each submitted when join_at(step, ids of the requests finished) says ->
    (tokens per request, stats per request)."""
    got, stats = {r.id: [] for r in reqs}, {}
    waiting, steps = list(reqs), 0
    while waiting or eng.has_work:
        for r in [r for r in waiting if join_at(r, steps, set(stats))]:
            eng.submit(r)
            waiting.remove(r)
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
            if ev.stats is not None:
                stats[ev.request_id] = ev.stats
        steps += 1
    return [got[r.id] for r in reqs], [stats[r.id] for r in reqs]


@pytest.mark.parametrize("k", [1, 4])
def test_suffix_drafts_give_mlx_lm_greedy_output(fixture_model, k):
    """Two rows joining at different times, then a third asking what the first asked: the
    fixture model copies nothing from its prompt, so it is the earlier output, in the
    shared index, that its drafts are kept from."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompts = [prompt_of(6, seed=1) * 3, prompt_of(9, seed=2), prompt_of(6, seed=1) * 3]
    want = [reference_greedy(ref, p, N) for p in prompts]
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k, draft_source="suffix"))
    assert isinstance(eng.proposer, SuffixProposer) and eng.pieces.head is None
    reqs = [Request(prompt=p, max_tokens=N) for p in prompts]
    schedule = {reqs[0].id: lambda steps, done: True, reqs[1].id: lambda steps, done: steps >= 3,
                reqs[2].id: lambda steps, done: reqs[0].id in done}
    got, stats = _run(eng, reqs, lambda r, steps, done: schedule[r.id](steps, done))
    assert got == want
    assert all(s.drafted > 0 for s in stats)
    assert stats[2].accepted >= (N - 4) // (k + 1)  # most of the repeated output was drafted
    # Requests gone from the batch: their state dropped as they left, their outputs in the
    # shared index.
    assert not eng.proposer.states
    assert eng.proposer.shared.tokens == 3 * N


def test_sampled_rows_draft_with_a_point_mass(fixture_model):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, draft_source="suffix"))
    reqs = [Request(prompt=prompt_of(8, seed=3), max_tokens=N, params=SamplingParams(temperature=0.7, seed=s))
            for s in (1, 2)] + [Request(prompt=prompt_of(8, seed=3), max_tokens=N)]
    got, stats = _run(eng, reqs, lambda r, steps, done: r is not reqs[1] or steps >= 2)
    assert [len(g) for g in got] == [N] * 3
    assert all(0 <= t < eng.vocab_size for g in got for t in g)
    assert all(s.drafted > 0 for s in stats)


def test_pipelined_drafting_is_off_for_a_drafter_that_cannot(fixture_model):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=2, draft_source="suffix", pipeline_drafts=True))
    assert not eng.pipeline_drafts and not eng.proposer.pipelines


def test_the_config_refuses_what_no_engine_runs(fixture_model):
    EngineConfig(num_draft=2, draft_source="suffix").validate()
    EngineConfig().validate()
    with pytest.raises(ValueError, match="draft_source must be one of"):
        EngineConfig(draft_source="ngram").validate()
    with pytest.raises(ValueError, match="fixed depth"):
        EngineConfig(draft_source="suffix").validate()
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    with pytest.raises(ValueError, match="fixed depth"):  # checked where the engine is built
        BatchGenerator(model, tok, dataclasses.replace(EngineConfig(), draft_source="suffix"))


def test_a_request_sent_back_to_wait_adds_its_output_once():
    """A row that leaves the batch for memory and resumes: what it wrote before leaving is
    in the shared index once, and what it writes after is added when it leaves again."""
    from types import SimpleNamespace

    proposer = SuffixProposer(vocab_size=300)
    req = SimpleNamespace(id=7, prompt=[1, 2, 3])
    row = SimpleNamespace(req=req, tokens=[1, 2, 3, 10, 11, 12])
    proposer.proposal(row, 4)
    proposer.drop_absent(set())  # sent back to wait
    assert proposer.shared.tokens == 3
    row.tokens += [13, 14]  # resumed, then finished
    proposer.proposal(row, 4)
    proposer.drop_absent(set())
    assert proposer.shared.tokens == 5


def test_a_file_read_earlier_is_drafted_across_lines_inside_a_json_string():
    """A Hermes-style tool call copies a file it read as a JSON string (newlines and quotes
    escaped): with the prompt's JSON view indexed, a copy under way (its first escaped line
    end written) is drafted on past the next escaped line end; with the prompt alone the
    draft is the raw text, which the model is not writing."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from mlxmtp.engine.proposers.views import PromptViews
    from mlxmtp.models import demo

    tok = AutoTokenizer.from_pretrained(str(demo.PACKAGED))
    code = 'def area(width, height):\n    """Rectangle."""\n    return width * height\n'
    prompt = tok.encode(f"<tool_response>\n{code}</tool_response>\n")
    call = '{"name": "Edit", "arguments": {"old_string": "' + json.dumps(code)[1:-1]
    said = tok.encode(call[: call.index("Rect") + 4])
    rest = tok.encode(call[call.index("Rect") + 4 : call.index("return") + 6])
    row = SimpleNamespace(req=SimpleNamespace(id=1, prompt=prompt), tokens=prompt + said)

    proposer = SuffixProposer(len(tok), views=PromptViews(tok))
    assert proposer.proposal(row, 32).tokens[: len(rest)] == rest
    assert proposer.states[1].drafter.output() == said  # the view is never output to share
    alone = SuffixProposer(len(tok)).proposal(row, 32)
    assert alone.tokens[: len(rest)] != rest


CODE = 'def area(width, height):\n    """Rectangle."""\n    return width * height\n\n\nclass Box:\n    pass\n'
LISTED = {  # how agents' Read tools number a file's lines
    "cat -n, nl -ba": lambda i, line: f"{i:6d}\t{line}",
    "flush left (Claude Code)": lambda i, line: f"{i}\t{line}",
    "arrow (Claude Code before)": lambda i, line: f"{i:6d}→{line}",
    "colon (OpenCode)": lambda i, line: f"{i}: {line}",
    "bar (OpenCode before)": lambda i, line: f"{i:05d}| {line}",
}


def _listing(style: str, code: str = CODE, first: int = 1) -> str:
    return "".join(LISTED[style](i, line) for i, line in enumerate(code.splitlines(keepends=True), first))


@pytest.mark.parametrize("style", LISTED)
def test_a_numbered_listing_is_viewed_without_its_numbers(style):
    from mlxmtp.engine.proposers.views import numbered_listings

    text = f"Read 7 lines\n{_listing(style, first=9)}Shown 9-15.\n2 of 3\n"
    assert numbered_listings(text) == [CODE]
    assert numbered_listings(text + _listing(style, "a\nb\nc\n", 40)) == [CODE, "a\nb\nc\n"]


def test_lines_that_only_look_numbered_are_left_alone():
    from mlxmtp.engine.proposers.views import numbered_listings

    assert numbered_listings("1\tone\n2\ttwo\n") == []  # two lines are no listing
    assert numbered_listings("10\ta\n20\tb\n30\tc\n40\td\n") == []  # not consecutive
    assert numbered_listings("1 apple\n2 pears\n3 plums\n") == []  # no separator of a listing


@pytest.mark.parametrize("arguments", ["xml", "json"])
def test_a_file_read_with_numbered_lines_is_drafted_across_lines(arguments):
    """A Read tool showed the file with its lines numbered; the Edit call copies it without
    them, raw (Qwen3-Coder XML) or JSON-escaped (Hermes): with the prompt's views indexed, a
    copy under way (its first line written) is drafted on across the next lines; with the
    prompt alone the draft runs into the next line's number."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from mlxmtp.engine.proposers.views import PromptViews
    from mlxmtp.models import demo

    tok = AutoTokenizer.from_pretrained(str(demo.PACKAGED))
    prompt = tok.encode(f"<tool_response>\n{_listing('flush left (Claude Code)')}</tool_response>\n")
    call = ('<function=Edit>\n<parameter=old_string>\n' + CODE if arguments == "xml"
            else '{"name": "Edit", "arguments": {"old_string": "' + json.dumps(CODE)[1:-1])
    said = tok.encode(call[: call.index("Rect") + 4])
    rest = tok.encode(call[call.index("Rect") + 4 : call.index("class")])
    row = SimpleNamespace(req=SimpleNamespace(id=1, prompt=prompt), tokens=prompt + said)

    proposer = SuffixProposer(len(tok), views=PromptViews(tok))
    assert proposer.proposal(row, 32).tokens[: len(rest)] == rest
    alone = SuffixProposer(len(tok)).proposal(row, 32)
    assert alone.tokens[: len(rest)] != rest


def test_a_loop_is_drafted_on_past_the_end_of_the_text():
    """Text repeating itself every 3 tokens: the longest match is the previous period, whose
    continuation stops where the text ends (3 tokens); the draft goes on around the loop, as
    far as the match reaches. Text that only ends where a match's continuation does, without
    having repeated, is drafted as far as it goes."""
    from types import SimpleNamespace

    def proposal(tokens, max_len):
        row = SimpleNamespace(req=SimpleNamespace(id=1, prompt=tokens[:2]), tokens=tokens)
        return SuffixProposer(vocab_size=300).proposal(row, max_len)

    looping = [1, 2] + [5, 6, 7] * 8
    assert proposal(looping, 16).tokens == [5, 6, 7] * 5 + [5]
    assert proposal(looping, 32).tokens == ([5, 6, 7] * 8)[:21]  # the match: 21 tokens
    once = [1, 2, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # "5 6 7" came once before: no loop yet
    assert proposal(once, 16).tokens == [8, 9, 5, 6]  # as long as its 4-token match


def test_a_patch_is_noticed_by_its_mark_and_its_escapes_by_the_line_end_before_it():
    from types import SimpleNamespace

    from mlxmtp.engine.proposers.views import PromptViews

    views = PromptViews(SimpleNamespace(decode="".join))  # a "tokenizer" of characters
    assert views.patch_start(list('print("a\\n")\n    return x\n')) is None
    assert views.patch_start(list('    print("a\\n")\n@@\n ')) is False  # raw, a string's escape before it
    assert views.patch_start(list("+++ b/geo.py\n@@ -1,3 +1,3 @@\n")) is False  # a unified diff
    assert views.patch_start(list('Begin Patch\\n*** Update File: geo.py\\n@@')) is True  # in a JSON string


@pytest.mark.parametrize("arguments", ["raw", "json"])
def test_a_patch_drafts_the_lines_it_keeps_and_removes_across_lines(arguments):
    """Codex's apply_patch copies the file's lines behind a mark, " " kept, "-" removed, raw or
    JSON-escaped in a tool call's arguments: once the output starts a patch (its "@@"), the
    prompt's lines behind each mark are indexed and a kept line's copy drafts on into the
    next; before that nothing is built for it, and without the views the draft stops short."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from mlxmtp.engine.proposers.views import PromptViews
    from mlxmtp.models import demo

    tok = AutoTokenizer.from_pretrained(str(demo.PACKAGED))
    prompt = tok.encode(f"<tool_response>\n{_listing('flush left (Claude Code)')}</tool_response>\n")
    lines = CODE.splitlines(keepends=True)
    patch = "*** Begin Patch\n*** Update File: geo.py\n@@\n" + "".join(" " + x for x in lines[:3]) + "-" + lines[5]
    call = patch if arguments == "raw" else '{"command": ["apply_patch", "' + json.dumps(patch)[1:-1]
    opening = tok.encode(call[: call.index("*** Update")])
    said = tok.encode(call[: call.index("Rect") + 4])
    rest = tok.encode(call[call.index("Rect") + 4 : call.index("return") + 6])
    proposer = SuffixProposer(len(tok), views=PromptViews(tok))
    row = SimpleNamespace(req=SimpleNamespace(id=1, prompt=prompt), tokens=prompt + opening)
    proposer.proposal(row, 32)
    assert not proposer.states[1].patching
    row.tokens = prompt + said
    assert proposer.proposal(row, 32).tokens[: len(rest)] == rest
    assert proposer.states[1].patching
    alone = SuffixProposer(len(tok)).proposal(row, 32)
    assert alone.tokens[: len(rest)] != rest


def test_a_tokenizer_that_fails_to_render_a_view_costs_the_view_only(caplog):
    """Views only speed drafting up: a tokenizer that raises while rendering them leaves the
    row drafting from its prompt and output, with one warning for each kind of view."""
    from types import SimpleNamespace

    from mlxmtp.engine.proposers.views import PromptViews

    def decode(ids):
        raise RuntimeError("no such token")

    proposer = SuffixProposer(300, views=PromptViews(SimpleNamespace(decode=decode)))
    row = SimpleNamespace(req=SimpleNamespace(id=1, prompt=[1, 2, 3, 4, 5, 6]), tokens=[1, 2, 3, 4, 5, 6, 1, 2])
    with caplog.at_level("WARNING", logger="mlxmtp"):
        assert proposer.proposal(row, 4).tokens == [3, 4]  # from the prompt, as without views
        row.tokens += [3, 4]
        assert proposer.proposal(row, 4).tokens[:2] == [5, 6]
    assert [r.getMessage().split(" of ")[0] for r in caplog.records] == [
        "suffix drafts: first", "suffix drafts: patch_start"]


def test_the_engine_drafts_from_its_prompts_views_and_stays_exact():
    """The engine's suffix drafter renders each prompt with the engine's tokenizer: a prompt
    holding a numbered listing is viewed without its numbers, and decodes mlx-lm's greedy
    tokens beside the head."""
    from mlxmtp.models.demo import demo_model_path

    model, tok, ref = loaded(str(demo_model_path()))
    prompt = tok.encode(f"# geometry.py\n{_listing('flush left (Claude Code)')}\n# geometry.py, again:\ndef area(width")
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, suffix_drafts=True))
    assert tok.encode(CODE) in eng.proposer.suffix.views.first(prompt)
    got, _ = _run(eng, [Request(prompt=prompt, max_tokens=N)], lambda r, steps, done: True)
    assert got == [reference_greedy(ref, prompt, N)]
