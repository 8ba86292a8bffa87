"""The end-to-end Llama comparison (e2e_llama.py) runs and agrees, at toy size on the CPU."""

import random

import pytest

pytest.importorskip("transformers")

import e2e_llama  # noqa: E402


def test_e2e_script_at_toy_size(tmp_path):
    rng = random.Random(0)
    words = [f"w{rng.randrange(300)}" for _ in range(5000)]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words))
    result = tmp_path / "e2e.json"
    code = e2e_llama.main(
        [
            "--text",
            str(text),
            "--device",
            "cpu",
            "--vocab",
            "1000",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "3",
            "--json",
            str(result),
        ]
    )
    assert code == 0 and result.exists()
