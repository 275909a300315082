"""The copy and edit tasks of the demo model (mlxmtp/models/demo_tasks.py): what the
copy fine-tune trains on and what `bench/decode.py --workload rename|edit` measures."""

import json
import random

from mlxmtp.models import demo_tasks

CODE = '''def scale(values, factor):
    out = []
    for value in values:
        out.append(value * factor)
    return out
'''


def test_snippet_starts_at_a_block_and_ends_on_a_whole_line():
    text = "import os\n\n" + CODE + "\n\nclass A:\n    x = 1\n    y = 2\n"
    for seed in range(5):
        code = demo_tasks.code_snippet(text, random.Random(seed), max_chars=90)
        assert code.startswith(("def scale", "class A")) and code.endswith("\n")
        assert len(code) <= 90
    assert demo_tasks.code_snippet("x = 1\n", random.Random(0)) is None


def test_rename_changes_whole_identifiers_only():
    old, new = demo_tasks.pick_rename(CODE, random.Random(1))
    assert CODE.count(old) >= 2 and new not in CODE
    assert demo_tasks.renamed(CODE, "value", "item") == CODE.replace("value * ", "item * ").replace(
        "for value in", "for item in")  # "values" is another name: kept


def test_edit_task_copies_the_file_it_read_into_old_string():
    messages, tools, answer = demo_tasks.edit_task("pkg/mod.py", CODE, "factor", "factor_key")
    assert messages[-1] == {"role": "tool", "content": CODE}
    assert [t["function"]["name"] for t in tools] == ["Read", "Edit"]
    args = json.loads(answer["tool_calls"][0]["function"]["arguments"])
    assert args["old_string"] == CODE
    assert args["new_string"] == CODE.replace("factor", "factor_key")


def test_held_out_tasks_come_from_held_out_files_only():
    from mlxmtp.models.demo import PACKAGED

    held = json.loads((PACKAGED / "training.json").read_text())["held_out_files"]
    tasks = demo_tasks.held_out_tasks("edit", 3)
    assert len(tasks) == 3
    for messages, _, _ in tasks:
        assert any(messages[0]["content"].startswith(f"In {name},") for name in held)


def test_rendered_prompt_is_the_conversation_without_its_answer():
    from transformers import AutoTokenizer

    from mlxmtp.models.demo import PACKAGED

    tok = AutoTokenizer.from_pretrained(str(PACKAGED))
    task = demo_tasks.rename_task(CODE, "factor", "factor_key")
    prompt = demo_tasks.render(tok, task, with_answer=False)
    whole = demo_tasks.render(tok, task, with_answer=True)
    assert whole.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    assert "factor_key" in whole[len(prompt):]
    want = demo_tasks.answer_ids(tok, task)
    assert demo_tasks.reproduced_share(want, want) == 1.0
    assert demo_tasks.reproduced_share(want, want[: len(want) // 2]) < 0.6
