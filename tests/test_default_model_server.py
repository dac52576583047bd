"""Out of the box: `pagedserve serve` with no --model serves SmolLM2 and answers sensibly."""
import pytest

from server_utils import RemoteServer


@pytest.mark.slow
def test_serve_without_model_answers_the_capital_of_france():
    from pagedserve.default_model import default_model_path

    try:
        default_model_path()
    except RuntimeError as e:
        pytest.skip(f"default model package missing (scripts/setup.sh installs it): {e}")
    from openai import OpenAI

    with RemoteServer(None, ["--max-model-len", "1024", "--kv-cache-space", "0.5"]) as srv:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none")
        models = client.models.list().data
        assert len(models) == 1 and "SmolLM2" in models[0].id
        r = client.chat.completions.create(model=models[0].id, max_tokens=24, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")
