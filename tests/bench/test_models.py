import pytest
import torch

from augtree_verl.models import BUILTIN_MODELS, load_model, vocab_size


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_models_are_seeded_and_train_mode(name):
    a, b, c = load_model(name, seed=1), load_model(name, seed=1), load_model(name, seed=2)
    wa, wb, wc = (m.get_input_embeddings().weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.training and wa.dtype == torch.float32 and vocab_size(a) == wa.shape[0]


def test_loading_does_not_touch_the_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    load_model("qwen2-tiny")
    assert torch.equal(torch.rand(3), expected)


def test_local_checkpoint_round_trip(tmp_path):
    model = load_model("qwen2-tiny", seed=3)
    model.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="'nope' is neither a built-in model"):
        load_model("nope")
