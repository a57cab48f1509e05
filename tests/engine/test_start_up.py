"""What a model's start pays for beside its weights: one-time costs that it must not pay."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.neuron_process import REPO


def _fresh_interpreter(code: str) -> str:
    """`code` run by a fresh interpreter (this one has imported whatever earlier tests did);
    its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=True,
    )
    return done.stdout.strip()


def test_a_model_skeleton_with_post_norms_imports_no_sympy() -> None:
    # `torch.empty_like` of a meta tensor imported torch's symbolic shapes and sympy: ~0.4 s
    # of every Gemma 3 start (its post-attention and post-FFN norms)
    out = _fresh_interpreter(
        """
        import sys
        from neuron_trio.engine.gguf.llama_config import LlamaConfig
        from neuron_trio.engine.model.transformer import Transformer
        config = LlamaConfig(
            n_layers=2, dim=64, n_heads=4, n_kv_heads=1, head_dim=16, ffn_dim=128,
            vocab_size=256, rope_base=10000.0, rope_dim=16, rms_eps=1e-6,
            context_length=128, tied_output=True, arch="gemma3", qk_norm=True,
            post_norms=True,
        )
        Transformer(config)
        print("sympy" in sys.modules)
        """
    )
    assert out == "False"
