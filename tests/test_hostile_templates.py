"""A chat template is the model file's code (it ran on the front's loop): whatever it does, the request gets
`BAD_REQUEST` naming the template, in bounded time and memory, and nothing escapes to end the node (a zero
division, a recursion or an overflow exited the front; a loop of 1e10 froze it for good; a large power took
5 s)."""
import time

import pytest

from meshnode.dev.hostile import TEMPLATES, branching_template
from meshnode.text.jinja import MAX_RENDER_WALL_S, ChatTemplate, TemplateError

def chatml(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def shared_host():
    from meshnode.text.templatehost import TemplateHost

    h = TemplateHost(branching_template(), "", "", False, False)
    yield h
    h.close()


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_hostile_template_is_the_requests_refusal_in_bounded_time(name, shared_host):
    """Through the template's own process, as the node renders (meshnode/text/templatehost.py): each shape is a
    TemplateError naming the template, and the same process serves an honest chat right after."""
    with pytest.raises(TemplateError) as e:
        shared_host.render([{"role": "user", "content": name}])
    assert "chat template" in str(e.value)
    assert shared_host.render([{"role": "user", "content": "hi"}]) == chatml("hi")


@pytest.mark.parametrize("name", [n for n in TEMPLATES if n not in ("a filter that allocates", "a string doubled")])
def test_in_process_the_sandbox_bounds_time(name):
    """The sandbox's own bounds (what the child relies on before its hard kill), in CPU time: no wall clock
    bound on a busy machine. The shapes that allocate are the child's memory bound's (above)."""
    t = ChatTemplate(TEMPLATES[name], "", "", False, False)
    t0 = time.thread_time()
    with pytest.raises(TemplateError):
        t.render([{"role": "user", "content": "hi"}])
    assert time.thread_time() - t0 < 20 * MAX_RENDER_WALL_S


def test_a_render_after_one_that_ran_over_is_untouched():
    """The watchdog's exception never lands outside the render it guarded."""
    slow = ChatTemplate(TEMPLATES["a bare loop"], "", "", False, False)
    fine = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}", "", "", False, False)
    with pytest.raises(TemplateError):
        slow.render([{"role": "user", "content": "hi"}])
    for _ in range(200):
        assert fine.render([{"role": "user", "content": "hi"}]) == "user:hi"
    time.sleep(3 * MAX_RENDER_WALL_S)
    assert fine.render([{"role": "user", "content": "hi"}]) == "user:hi"


# -- the template's own process (meshnode/text/templatehost.py): memory, a stuck child, a dead one ----------
@pytest.fixture
def host():
    from meshnode.text.templatehost import TemplateHost

    h = TemplateHost(branching_template(), "", "", False, False)
    yield h
    h.close()


def _say(host, content):
    return host.render([{"role": "user", "content": content}])


def test_a_template_that_allocates_past_its_bound_is_refused_and_the_next_render_is_served(host):
    """`center` makes a 2 GB string in one C call, which no sandbox hook sees: the child's RLIMIT_AS does."""
    assert _say(host, "hi") == chatml("hi")
    with pytest.raises(TemplateError, match="MiB|MemoryError"):
        _say(host, "a filter that allocates")
    assert _say(host, "hi again") == chatml("hi again") and host.restarts == 0


def test_a_child_that_outlives_the_hard_bound_is_killed_and_replaced(host, monkeypatch):
    from meshnode.text import templatehost

    assert _say(host, "hi") == chatml("hi")
    monkeypatch.setattr(templatehost, "HARD_WALL_S", 0.05)  # under the child's own watchdog: the parent's kill
    with pytest.raises(TemplateError, match="ran past"):
        _say(host, "a bare loop")
    assert host.restarts == 1
    monkeypatch.setattr(templatehost, "HARD_WALL_S", 60.0)
    assert _say(host, "hi") == chatml("hi")


def test_a_child_that_died_between_renders_costs_no_request(host):
    import os
    import signal

    assert _say(host, "hi") == chatml("hi")
    os.kill(host._proc.pid, signal.SIGKILL)
    host._proc.wait()
    assert _say(host, "still here") == chatml("still here") and host.restarts == 1


def test_the_dates_a_render_prints_are_the_front_clocks(host, monkeypatch):
    """Tests (and references) set the day in the front's process; the child renders with it."""
    from datetime import datetime

    from meshnode.text import jinja
    from meshnode.text.templatehost import TemplateHost

    monkeypatch.setattr(jinja, "now", lambda: datetime(2024, 7, 26))
    dated = TemplateHost("{{ date_string }}|{{ strftime_now('%Y') }}", "", "", False, False)
    try:
        assert dated.render([{"role": "user", "content": "x"}]) == "26 Jul 2024|2024"
    finally:
        dated.close()


def test_a_node_whose_template_turns_hostile_refuses_those_chats_and_serves_everyone(tmp_path):
    """The node's ready line came (its probe render is a plain one); a chat that makes the template allocate
    gigabytes or loop is that request's refusal naming the template, and the next chat, from another client,
    is served as before."""
    from meshnode.dev.nodeproc import NodeProcess
    from meshnode.ops.models import make_model

    model = str(make_model(tmp_path / "m.gguf", "tiny-bpe", 0, chat_template=branching_template()))
    with NodeProcess(model, "--max-active", "2") as node, node.client() as attacker, node.client() as other:
        for i, what in enumerate(["a filter that allocates", "a bare loop", "recursion"]):
            r = attacker.generate(f"h{i}", messages=[{"role": "user", "content": what}], max_tokens=2)
            assert r.rejected and r.admission["reason"] == "REJECTED_BAD_REQUEST", r.admission
            assert "chat template" in r.admission["detail"]
        ok = other.generate("v", messages=[{"role": "user", "content": "hello"}], max_tokens=3, ignore_eos=True)
        assert ok.done["reason"] == "LENGTH" and len(ok.done["tokens"]) == 3
        assert other.ping(30.0)
