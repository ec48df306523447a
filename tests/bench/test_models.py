import pytest
import torch

from augtree_verl.models import BUILTIN_MODELS, LINEAR_DECAY_A, load_model, vocab_size
from augtree_verl.replay.linear_state import SCANNED_MODEL_TYPES, linear_attention_modules, linear_layers
from augtree_verl.replay.model_check import check_model


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


def test_hybrid_passes_the_engine_checks_with_qwen35_layers_and_decays():
    model = load_model("qwen3.5-small")
    check_model(model)  # the engine's build-time refusals: none
    assert model.config.model_type in SCANNED_MODEL_TYPES  # its CP plans run through the state scan
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert linear_layers(model) == {0, 1, 2}
    for module in linear_attention_modules(model):
        a = module.A_log.exp()
        assert LINEAR_DECAY_A[0] <= a.min() and a.max() <= LINEAR_DECAY_A[1]
