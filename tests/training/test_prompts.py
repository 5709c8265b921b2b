"""Training prompts: standalone function stubs are valid, dedented, end after their docstring, and repeatable."""

import ast

from specbuild.training import distill


def test_stub_prompts_are_standalone_signature_and_docstring():
    stubs = distill.stub_prompts(40, seed=5)
    assert len(stubs) == 40
    for text in stubs:
        tree = ast.parse(text + "    pass\n")  # a body is all that is missing
        (func,) = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert ast.get_docstring(func) is not None
        assert len(func.body) == 2  # the docstring, then our `pass`: nothing of the original body leaked in
        assert not func.name.startswith("__")
        assert [a.arg for a in func.args.args[:1]] not in (["self"], ["cls"])
        assert text.endswith("\n") and text.rstrip("\n")[-1] in "\"'"  # cut right after the docstring
        for name in ("List", "Dict", "Tuple", "Optional"):
            if f"{name}[" in ast.unparse(func.args) + ast.unparse(func.returns or ast.Constant(None)):
                assert text.startswith("from typing import") and name in text.splitlines()[0]
    assert distill.stub_prompts(40, seed=5) == stubs
    assert distill.stub_prompts(40, seed=6) != stubs


def test_build_prompts_tags_stubs():
    class Tok:  # whitespace "tokenizer": build_prompts only needs __call__ for raw prompts
        def __call__(self, text):
            return {"input_ids": list(range(len(text.split())))}

    prompts = distill.build_prompts(Tok(), 0, 0, seed=1, n_stub=5, max_prompt_tokens=10_000)
    assert [p["kind"] for p in prompts] == ["stub"] * 5
    assert len({p["id"] for p in prompts}) == 5
