"""The loss record beside a PEFT adapter saved alone (hf_mhce.json) and the card around it: a record the folder's
weights were not saved with is not applied, an adapter folder refuses output_loading_info by name, and the card
of adapters PEFT saves in subfolders (names other than "default") says where they are."""

import json

import pytest
import torch
from patching_models import batch, saved_base, with_lora
from peft import LoraConfig

import hf_mhce
from hf_mhce.patching import apply_patch, is_patched, unpatch
from hf_mhce.patching.config import ADAPTER_CONFIG_FILE, WEIGHTS_DIGEST_KEY


def _adapter(tmp_path, **peft_kw):
    return with_lora(saved_base(tmp_path), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), **peft_kw)


def test_a_record_left_from_an_earlier_save_is_not_applied(tmp_path):
    """Saved as MHCE, unpatched, saved again into the same folder: PEFT rewrites the weights, hf_mhce's own
    save no longer runs, and the old hf_mhce.json stayed and reloaded the plain adapter as MHCE with 4 heads."""
    model = apply_patch(_adapter(tmp_path), loss="mhce", num_heads=4)
    model.save_pretrained(tmp_path / "adapter")
    record = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text())
    assert record["num_heads"] == 4 and len(record[WEIGHTS_DIGEST_KEY]) == 64
    loaded = hf_mhce.from_pretrained(tmp_path / "adapter")  # as saved: the record applies
    assert loaded.get_base_model().config.hf_mhce["num_heads"] == 4

    unpatch(model)
    with torch.no_grad():  # other weights than the record was written with
        model.base_model.model.lm_head.lora_B["default"].weight.mul_(2.0)
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / ADAPTER_CONFIG_FILE).exists()  # left by the first save
    with pytest.warns(UserWarning, match=r"written for other adapter weights.*not applied"):
        reloaded = hf_mhce.from_pretrained(tmp_path / "adapter").eval()
    assert reloaded.get_base_model().config.hf_mhce["loss"] == "ce"
    ids, labels = batch()
    with torch.no_grad():  # the plain model's loss, as the second save meant
        torch.testing.assert_close(reloaded(input_ids=ids, labels=labels).loss,
                                   model.eval()(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=0)


def test_a_record_without_a_digest_still_applies(tmp_path):
    """hf_mhce.json as sessions before the digest wrote it: read as before."""
    apply_patch(_adapter(tmp_path), loss="mhce", num_heads=2).save_pretrained(tmp_path / "adapter")
    path = tmp_path / "adapter" / ADAPTER_CONFIG_FILE
    record = json.loads(path.read_text())
    del record[WEIGHTS_DIGEST_KEY]
    path.write_text(json.dumps(record))
    assert hf_mhce.from_pretrained(tmp_path / "adapter").get_base_model().config.hf_mhce["num_heads"] == 2


def test_output_loading_info_is_refused_for_an_adapter_folder(tmp_path):
    """PEFT's loader builds the base with the options given and took its (model, report) for a model
    (AttributeError: 'tuple' object has no attribute 'named_modules', deep inside PEFT)."""
    apply_patch(_adapter(tmp_path)).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"output_loading_info=True .* is a PEFT adapter"):
        hf_mhce.from_pretrained(tmp_path / "adapter", output_loading_info=True)
    model, info = hf_mhce.from_pretrained(tmp_path / "base", output_loading_info=True)  # a checkpoint: as transformers
    assert set(info) >= {"missing_keys", "unexpected_keys"} and is_patched(model)


def test_the_card_of_a_named_adapter_says_where_it_is(tmp_path):
    """An adapter named "mine" is saved in <dir>/mine, <dir> holding only the card: it said the record was in
    config.json (there is none) and loaded <dir>, which from_pretrained refuses (adapters in subdirectories)."""
    model = apply_patch(_adapter(tmp_path, adapter_name="mine"), loss="mhce", num_heads=2)
    model.save_pretrained(tmp_path / "ad")
    card = (tmp_path / "ad" / "README.md").read_text()
    assert "`hf_mhce.json` beside the adapter" in card and "config.json" not in card.split("hf_mhce")[-1]
    loading = str((tmp_path / "ad" / "mine").resolve())
    assert f'from_pretrained("{loading}")' in card, card
    assert hf_mhce.from_pretrained(loading).get_base_model().config.hf_mhce["num_heads"] == 2
