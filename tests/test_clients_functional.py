"""Real client libraries against a real `octo serve` (llama.cpp, the tiny synthetic random-weight GGUF): instructor
(modes TOOLS and JSON_SCHEMA) extracts a pydantic model, and langchain-openai's ``bind_tools`` and
``with_structured_output`` get a valid tool call and a valid object. Random weights cannot produce these by chance:
the shared constrained-decoding layer does."""

from __future__ import annotations

from typing import Annotated

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
from pydantic import BaseModel, Field  # noqa: E402
from serverproc import run_octo  # noqa: E402

Small = Annotated[int, Field(ge=-999, le=999)]  # random weights' digits need not end: the bound ends them


class User(BaseModel):
    name: str = Field(max_length=12, description="the user's first name")
    age: int = Field(ge=0, le=150)
    admin: bool


@pytest.fixture(scope="module")
def server():
    from octo.synth.gguf import build_gguf

    with run_octo(str(build_gguf("tiny", ftype="q8_0")), "--engine", "llamacpp") as s:
        s.model = s.openai().models.list().data[0].id
        yield s


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_pydantic_model(server, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(server.openai(), mode=getattr(instructor.Mode, mode))
    user = client.chat.completions.create(model=server.model, response_model=User, max_retries=0, max_tokens=200,
                                          messages=[{"role": "user", "content": "Extract: Ann is 31, an admin."}])
    assert isinstance(user, User)
    assert len(user.name) <= 12 and 0 <= user.age <= 150


def _chat(server):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", model=server.model,
                         max_tokens=200, temperature=0.7, max_retries=0)


def test_langchain_bind_tools(server):
    from langchain_core.tools import tool

    @tool
    def multiply(a: Small, b: Small) -> int:
        """Multiply two integers."""
        return a * b

    msg = _chat(server).bind_tools([multiply], tool_choice="multiply").invoke("What is 6 times 7?")
    (call,) = msg.tool_calls
    assert call["name"] == "multiply" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) and -999 <= v <= 999 for v in call["args"].values())
    assert multiply.invoke(call["args"]) == call["args"]["a"] * call["args"]["b"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(server, method):
    out = _chat(server).with_structured_output(User, method=method).invoke("Ann is 31 and an admin.")
    assert isinstance(out, User)
