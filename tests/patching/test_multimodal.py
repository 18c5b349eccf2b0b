"""Vision-language models: the patched forward runs the multimodal base (which merges the images into
the text), never the text decoder alone, so images reach the loss, the gradients, the logits and
generate(); a model whose forward would lose an input is refused by name.  Tiny random models, images
laid out as each processor lays them out, image tokens labelled -100."""

import copy
import inspect

import pytest
import torch
import transformers as T
from patching_models import grads

import hf_mhce
from hf_mhce.patching import UnsupportedModelError, apply_patch

V, IMAGE = 128, 120
TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=2)
CLIP = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, image_size=8, patch_size=4)
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, image_size=8, patch_size=4)


def _text(n_rows, n_tokens, seed):
    return torch.randint(3, 100, (n_rows, n_tokens), generator=torch.Generator().manual_seed(seed))


def qwen2_vl(seed=0):
    """<vision_start> 4 x <image_pad> <vision_end> per row: a 4x4 patch grid merged 2x2."""
    config = T.Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=IMAGE, video_token_id=123, vision_start_token_id=121, vision_end_token_id=122)
    text = _text(2, 6, seed)
    ids = torch.cat([text[:, :2], torch.full((2, 1), 121), torch.full((2, 4), IMAGE), torch.full((2, 1), 122),
                     text[:, 2:]], 1)
    images = dict(pixel_values=torch.randn(32, 24, generator=torch.Generator().manual_seed(seed)),
                  image_grid_thw=torch.tensor([[1, 4, 4]] * 2), mm_token_type_ids=(ids == IMAGE).int())
    return T.Qwen2VLForConditionalGeneration(config), ids, images


def llava(seed=0):
    """4 <image> tokens (2x2 patches of an 8x8 image, CLS dropped) before the text."""
    config = T.LlavaConfig(text_config=dict(TEXT, model_type="llama"), vision_config=CLIP, image_token_index=IMAGE)
    ids = torch.cat([torch.full((2, 4), IMAGE), _text(2, 6, seed)], 1)
    images = dict(pixel_values=torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)))
    return T.LlavaForConditionalGeneration(config), ids, images


def gemma3(seed=0):
    """<boi> 4 x <image> <eoi>; token_type_ids mark the image (bidirectional attention in training)."""
    config = T.Gemma3Config(text_config=dict(TEXT, head_dim=8), vision_config=SIGLIP, mm_tokens_per_image=4,
                            image_token_index=IMAGE, boi_token_index=121, eoi_token_index=122)
    text = _text(2, 6, seed)
    ids = torch.cat([text[:, :1], torch.full((2, 1), 121), torch.full((2, 4), IMAGE), torch.full((2, 1), 122),
                     text[:, 1:]], 1)
    images = dict(pixel_values=torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)),
                  token_type_ids=(ids == IMAGE).long())
    return T.Gemma3ForConditionalGeneration(config), ids, images


def mllama(seed=0):
    """<|image|> at position 1; the text after it cross-attends to the image's 2 tiles (gates opened:
    at their initial 0 the image would not change the text)."""
    vision = dict(hidden_size=16, num_hidden_layers=2, num_global_layers=1, attention_heads=2, intermediate_size=32,
                  vision_output_dim=48, image_size=8, patch_size=4, max_num_tiles=2, intermediate_layers_indices=[0, 1],
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    model = T.MllamaForConditionalGeneration(T.MllamaConfig(
        vision_config=vision, text_config=dict(TEXT, cross_attention_layers=[1]), image_token_index=IMAGE))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "cross_attn" in name and "gate" in name:
                p.fill_(0.5)
    ids = _text(2, 10, seed)
    ids[:, 1] = IMAGE
    cross_mask = torch.zeros(2, 10, 1, 2, dtype=torch.long)
    cross_mask[:, 1:] = 1
    images = dict(pixel_values=torch.randn(2, 1, 2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)),
                  aspect_ratio_ids=torch.tensor([[2], [2]]), aspect_ratio_mask=torch.ones(2, 1, 2, dtype=torch.long),
                  cross_attention_mask=cross_mask)
    return model, ids, images


def fuyu(seed=0):
    """4 image-patch placeholders, then text; pixel_values are the flattened 4x4 patches."""
    # transformers 5.17's Fuyu projects the patches to a hidden_size of its own config (not the text config's)
    own = {"hidden_size": TEXT["hidden_size"]} if "hidden_size" in T.FuyuConfig.__dataclass_fields__ else {}
    config = T.FuyuConfig(text_config=dict(TEXT, model_type="persimmon"), image_size=8, patch_size=4, num_channels=3,
                          image_token_id=IMAGE, **own)
    ids = torch.cat([torch.full((2, 4), IMAGE), _text(2, 6, seed)], 1)
    # and takes them as image_patches (a pixel_values it does not know is ignored: no image)
    key = "pixel_values" if "pixel_values" in inspect.signature(T.FuyuForCausalLM.forward).parameters else "image_patches"
    images = {key: torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(seed))}
    return T.FuyuForCausalLM(config), ids, images


def internvl(seed=0):
    """4 <IMG_CONTEXT> tokens (a 4x4 patch grid pixel-shuffled by 0.5); image_sizes goes to the base's
    **kwargs in the original too, so the patch hands it on the same way."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=[16, 16],
                  patch_size=[4, 4])
    config = T.InternVLConfig(vision_config=vision, text_config=dict(TEXT, model_type="qwen2"), image_token_id=IMAGE,
                              downsample_ratio=0.5)
    ids = torch.cat([torch.full((2, 4), IMAGE), _text(2, 6, seed)], 1)
    images = dict(pixel_values=torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed)),
                  image_sizes=torch.tensor([[16, 16]] * 2))
    return T.InternVLForConditionalGeneration(config), ids, images


def paligemma(seed=0):
    """PaliGemma 2 (a Gemma-2 text model, whose final-logit soft-cap the forward reads from the text
    config): 4 <image> tokens (a 2x2 SigLIP patch grid) before the text."""
    text = dict(TEXT, model_type="gemma2", head_dim=8, final_logit_softcapping=2.0)
    config = T.PaliGemmaConfig(text_config=text, vision_config=dict(SIGLIP, projection_dim=32), image_token_index=IMAGE,
                               projection_dim=32)
    ids = torch.cat([torch.full((2, 4), IMAGE), _text(2, 6, seed)], 1)
    images = dict(pixel_values=torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)))
    model = T.PaliGemmaForConditionalGeneration(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)  # logits near the cap: without it the loss would differ
    return model, ids, images


BUILDERS = {"paligemma": paligemma, "qwen2_vl": qwen2_vl, "llava": llava, "gemma3": gemma3, "mllama": mllama,
            "fuyu": fuyu, "internvl": internvl}


def build(name, seed=0):
    torch.manual_seed(0)
    model, ids, images = BUILDERS[name](seed)
    with torch.no_grad():  # off the initial values, some of which (Gemma-3's projector: zeros) hide the image
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model.float(), ids, images


def _loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, grads(model)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_images_reach_loss_gradients_and_logits(name):
    ref, ids, images = build(name)
    model = apply_patch(copy.deepcopy(ref))
    labels = ids.masked_fill(ids == IMAGE, -100)
    ref.train(), model.train()  # Gemma-3's base builds its training mask from the labels
    want, want_grads = _loss_and_grads(ref, input_ids=ids, labels=labels, **images)
    got, got_grads = _loss_and_grads(model, input_ids=ids, labels=labels, **images)
    torch.testing.assert_close(got.loss, want.loss)
    assert got_grads.keys() == want_grads.keys()
    largest = max(g.abs().max() for g in want_grads.values()).item()
    for n, g in want_grads.items():  # attention key biases: zero in exact arithmetic, compared as the noise they are
        torch.testing.assert_close(got_grads[n], g, rtol=1e-4, atol=1e-6 * largest, msg=lambda m: f"{n}: {m}")
    vision = [n for n in want_grads if "vision" in n or "visual" in n]  # Fuyu: vision_embed_tokens
    assert vision and all(got_grads[n] is not None for n in vision)  # the vision tower trains
    fields = type(want).__dataclass_fields__  # the vision tower's output reaches ours as HF's
    if "image_outputs" in fields and want.image_outputs is not None:  # transformers >= 5.24
        torch.testing.assert_close(got.image_outputs.to_tuple(), want.image_outputs.to_tuple())
    elif "image_hidden_states" in fields and want.image_hidden_states is not None:
        torch.testing.assert_close(got.image_hidden_states, want.image_hidden_states)
    ref.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, **images).logits, ref(input_ids=ids, **images).logits)
        _, _, other = build(name, seed=1)
        changed = model(input_ids=ids, labels=labels, **other).loss
    assert not torch.isclose(changed, got.loss)  # another image, another loss


def test_mhce_generation_sees_the_image_and_reloads(tmp_path):
    ref, ids, images = build("qwen2_vl")
    model = apply_patch(ref, loss="mhce", num_heads=2).eval()
    prompt = dict(input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]), image_grid_thw=images["image_grid_thw"][:1],
                  mm_token_type_ids=images["mm_token_type_ids"][:1])

    def first_scores(pixel_values):
        with torch.no_grad():
            out = model.generate(**prompt, pixel_values=pixel_values, max_new_tokens=2, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        return out.logits[0][0]

    scores = first_scores(images["pixel_values"][:16])
    with torch.no_grad():  # generate's first step is the forward's mixture log-probs at the last position
        step = model(**prompt, pixel_values=images["pixel_values"][:16]).logits[0, -1]
    torch.testing.assert_close(scores, step)
    torch.testing.assert_close(scores.exp().sum(), torch.tensor(1.0))
    assert not torch.allclose(first_scores(images["pixel_values"][16:] * 3), scores)
    model.save_pretrained(tmp_path)
    reloaded = hf_mhce.from_pretrained(tmp_path).eval()  # AutoModelForCausalLM cannot load Qwen2-VL
    assert type(reloaded) is type(model) and reloaded.config.hf_mhce["num_heads"] == 2
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**prompt, pixel_values=images["pixel_values"][:16]).logits[0, -1], step)


def test_mllama_reloads_as_the_vision_model(tmp_path):
    """AutoModelForCausalLM would load Mllama's text model alone, without the images or the loss config."""
    model, ids, images = build("mllama")
    apply_patch(model, loss="mhce", num_heads=2).eval()
    model.save_pretrained(tmp_path)
    reloaded = hf_mhce.from_pretrained(tmp_path).eval()
    assert type(reloaded) is T.MllamaForConditionalGeneration and reloaded.config.hf_mhce["loss"] == "mhce"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, **images).logits, model(input_ids=ids, **images).logits)


def test_a_forward_that_would_drop_images_is_refused():
    """Llama-4 merges the images in its own forward, around a text model: the generic forward cannot."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4, vision_output_dim=16, projector_input_dim=16, projector_output_dim=32,
                  pixel_shuffle_ratio=0.5, rope_theta=1e4)
    text = dict(TEXT, intermediate_size_mlp=64, num_local_experts=2, head_dim=8, interleave_moe_layer_step=1,
                attention_chunk_size=16)
    with torch.device("meta"):
        model = T.Llama4ForConditionalGeneration(T.Llama4Config(text_config=text, vision_config=vision,
                                                                image_token_index=IMAGE))
    with pytest.raises(UnsupportedModelError, match=r"takes \[.*'pixel_values'.*\].*would be dropped"):
        apply_patch(model)
    assert "forward" not in model.__dict__ and "hf_mhce" not in model.config.to_dict()


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_peft_adapter_on_a_vision_language_base_reloads(tmp_path, task_type):
    """AutoPeftModelForCausalLM builds a CAUSAL_LM adapter's base with AutoModelForCausalLM, which
    cannot load Qwen2-VL: from_pretrained builds it with the base's saved class."""
    import peft

    model, ids, images = build("qwen2_vl")
    model.save_pretrained(tmp_path / "base")
    base = T.Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "base")  # records the base's path
    lora = peft.LoraConfig(task_type=task_type, r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    tuned = apply_patch(peft.get_peft_model(base, lora), loss="mhce", num_heads=2).eval()
    labels = ids.masked_fill(ids == IMAGE, -100)
    with torch.no_grad():
        want = tuned(input_ids=ids, labels=labels, **images).loss
    tuned.save_pretrained(tmp_path / "adapter")
    reloaded = hf_mhce.from_pretrained(tmp_path / "adapter").eval()
    assert type(reloaded.get_base_model()) is T.Qwen2VLForConditionalGeneration
    assert reloaded.get_base_model().config.hf_mhce["num_heads"] == 2
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, labels=labels, **images).loss, want)
