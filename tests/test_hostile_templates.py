"""A chat template is the model file's code, run on the front's loop: whatever it does, the request gets
`BAD_REQUEST` naming the template, in bounded time and memory, and nothing escapes to end the node (a zero
division, a recursion or an overflow exited the front; a loop of 1e10 froze it for good; a large power took
5 s)."""
import time

import pytest

from meshnode.text.jinja import MAX_RENDER_WALL_S, ChatTemplate, TemplateError

HOSTILE = {
    "zero division": "{{ 1 / 0 }}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "overflow": "{{ 1e308 * 10 ** 5 }}{{ (2 ** 60) | float ** 40 }}",
    "a large power": "{{ 7 ** 12345678 }}",
    "a huge repetition": "{{ 'x' * 10 ** 9 }}",
    "a list repeated": "{% set l = [0] * 100000000 %}{{ l | length }}",
    "nested calls": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "a bare loop": "{% set r = range(100000) | list %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
    "a range past the sandbox": "{% for i in range(10 ** 10) %}{% endfor %}",
    "unsafe attributes": "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
    "raise_exception": "{{ raise_exception('no') }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_the_requests_refusal_in_bounded_time(name):
    t = ChatTemplate(HOSTILE[name], "", "", False, False)
    t0 = time.thread_time()
    with pytest.raises(TemplateError) as e:
        t.render([{"role": "user", "content": "hi"}])
    assert "chat template" in str(e.value)
    assert time.thread_time() - t0 < 20 * MAX_RENDER_WALL_S  # CPU time: no wall clock bound on a busy machine


def test_a_render_after_one_that_ran_over_is_untouched():
    """The watchdog's exception never lands outside the render it guarded."""
    slow = ChatTemplate(HOSTILE["a bare loop"], "", "", False, False)
    fine = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}", "", "", False, False)
    with pytest.raises(TemplateError):
        slow.render([{"role": "user", "content": "hi"}])
    for _ in range(200):
        assert fine.render([{"role": "user", "content": "hi"}]) == "user:hi"
    time.sleep(3 * MAX_RENDER_WALL_S)
    assert fine.render([{"role": "user", "content": "hi"}]) == "user:hi"
