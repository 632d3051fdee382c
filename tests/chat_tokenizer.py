"""A tiny local tokenizer for chat tests: UTF-8 bytes (byte-level BPE without merges) plus every
marker of the named chat templates as one special token; no hub. The byte alphabet is sorted:
``tokenizers`` returns it in a different order in every process, which gave every test a different
vocabulary (and different numbers) from run to run."""
import json
import re

from functional_pp.data.chat import template_names, template_text

EXTRA = ["<|begin_of_text|>", "<|end_of_text|>", "<s>", "</s>", "<bos>", "<eos>", "<BOS_TOKEN>", "<｜begin▁of▁sentence｜>",
         "<unk>"]
_MARK = re.compile(r"<[|｜][^<>'\"\s]{1,40}[|｜]>|<(?:start|end)_of_turn>|\[/?INST\]|\[/?SYSTEM_PROMPT\]|"
                   r"\[/?AVAILABLE_TOOLS\]|\[TOOL_CALLS\]|\[/?TOOL_RESULTS\]")


def special_tokens() -> list[str]:
    found = set()
    for name in template_names():
        found |= set(_MARK.findall(template_text(name)))
    return sorted(found) + EXTRA


def make_tokenizer(d, bos, eos, template=None, extra=()):
    """A byte-level tokenizer (no merges) with every template marker (and ``extra``) as one special token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    markers = [*special_tokens(), *(s for s in dict.fromkeys((bos, eos, *extra)) if s and s not in special_tokens())]
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in markers])
    d.mkdir(parents=True, exist_ok=True)
    t.save(str(d / "tokenizer.json"))
    cfg = {"eos_token": eos}
    if bos:
        cfg["bos_token"] = bos
    if template:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    from functional_pp.data.tokenizer import HFTokenizer
    return HFTokenizer(d)


def make_bpe_tokenizer(d, bos, eos, texts, vocab_size=600):
    """A byte-level BPE trained here on ``texts`` (merges join characters across the places
    where a template's header meets a message), with the templates' markers as special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
                                  show_progress=False)
    t.train_from_iterator(texts, trainer)
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special_tokens()])
    d.mkdir(parents=True, exist_ok=True)
    t.save(str(d / "tokenizer.json"))
    cfg = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    from functional_pp.data.tokenizer import HFTokenizer
    return HFTokenizer(d)


#: a word-start pre-tokenizer regex (tiktoken pat_str), as Tekken's
_TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                   r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?"
                   r"[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]


def make_tekken(d, version: str = "v7", specials: int = 100):
    """A tiny mistral-common Tekken tokenizer file ``d/tekken.json`` (UTF-8 bytes plus a few
    merges after ``specials`` control tokens: 262 + specials ids); no hub."""
    import base64
    pieces = [bytes([i]) for i in range(256)] + [b"th", b"he", b"in", b" t", b"is", b" is"]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(p).decode(), "token_str": p.decode("latin-1")}
             for i, p in enumerate(pieces)]
    data = {"config": {"pattern": _TEKKEN_PATTERN, "num_vocab_tokens": len(vocab),
                       "default_vocab_size": len(vocab) + specials, "default_num_special_tokens": specials,
                       "version": version},
            "vocab": vocab, "version": 1, "type": "Tekken",
            "special_tokens": [{"rank": i, "token_str": s, "is_control": True}
                               for i, s in enumerate(_TEKKEN_SPECIALS)]}
    d.mkdir(parents=True, exist_ok=True)
    (d / "tekken.json").write_text(json.dumps(data))
    return d / "tekken.json"


#: the tiny Pixtral processor's special tokens, in id order after the 256 bytes
PIXTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>"]
#: a Mistral-style chat template rendering an image entry as the processor's image token
PIXTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]{% if m.content is string %}"
                    "{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'image' %}[IMG]{% else %}"
                    "{{ c.text }}{% endif %}{% endfor %}{% endif %}[/INST]{% else %}{% if m.content is string %}"
                    "{{ m.content }}{% else %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endif %}"
                    "{{ eos_token }}{% endif %}{% endfor %}")


def write_pixtral_processor_files(d, patch, merge, longest_edge):
    """``processor_config.json``, ``preprocessor_config.json`` (the real ``PixtralImageProcessor``,
    PIL backend) and ``chat_template.jinja`` of a Pixtral processor in ``d``, beside its tokenizer."""
    import transformers
    transformers.PixtralImageProcessorPil(size={"longest_edge": longest_edge},
                                          patch_size={"height": patch * merge, "width": patch * merge}
                                          ).save_pretrained(str(d))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": patch, "spatial_merge_size": merge,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}))
    (d / "chat_template.jinja").write_text(PIXTRAL_TEMPLATE)


GEMMA4_IMAGE_TOKENS = ("<|image|>", "<|image>", "<image|>")
"""Gemma 4's image token, begin-of-image and end-of-image tokens."""


def write_gemma4_processor_files(d, patch=16, pool=3, max_soft_tokens=70, unified=False):
    """``processor_config.json`` and ``preprocessor_config.json`` (the real ``Gemma4ImageProcessor``,
    PIL backend: resizes within ``max_soft_tokens`` soft tokens of ``pool``² patches) of a Gemma 4
    processor in ``d``, beside its tokenizer, and its ``chat_template.jinja`` (Axolotl's ``gemma4_unified``);
    ``unified``: named as Gemma 4 unified's (``Gemma4UnifiedProcessor``, ``Gemma4UnifiedImageProcessor``:
    the same keys)."""
    import transformers

    from functional_pp.data.chat import template_text
    transformers.Gemma4ImageProcessorPil(patch_size=patch, pooling_kernel_size=pool,
                                        max_soft_tokens=max_soft_tokens).save_pretrained(str(d))
    image, boi, eoi = GEMMA4_IMAGE_TOKENS
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4UnifiedProcessor" if unified else "Gemma4Processor", "image_token": image,
        "boi_token": boi, "eoi_token": eoi}))
    if unified:
        conf = json.loads((d / "preprocessor_config.json").read_text())
        (d / "preprocessor_config.json").write_text(json.dumps({**conf,
                                                                "image_processor_type": "Gemma4UnifiedImageProcessor"}))
    (d / "chat_template.jinja").write_text(template_text("gemma4_unified"))


def make_pixtral_processor(d, patch=4, merge=2, longest_edge=32):
    """A tiny Pixtral processor's files in ``d`` (as ``PixtralProcessor.save_pretrained`` writes them):
    a byte-level tokenizer with Mistral's image tokens ([IMG] is id 260), the real
    ``PixtralImageProcessor`` (PIL backend) resizing to at most ``longest_edge`` pixels in multiples
    of ``patch * merge``, ``processor_config.json`` and :data:`PIXTRAL_TEMPLATE`."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in PIXTRAL_SPECIALS])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>")
    tok.save_pretrained(str(d))
    write_pixtral_processor_files(d, patch, merge, longest_edge)


#: the tiny Qwen processor's special tokens, in id order after the 256 bytes (<|image_pad|> is id 260)
QWEN_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                    "<|vision_end|>"]
#: a ChatML chat template rendering an image entry as Qwen's vision_start, image_pad, vision_end
QWEN_VL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                    "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|>"
                    "<|vision_end|>{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")


def write_qwen_vl_processor_files(d, patch=4, merge=2, temporal=2, max_pixels=1024, processor="Qwen3VLProcessor"):
    """``processor_config.json``, ``preprocessor_config.json`` (the real ``Qwen2VLImageProcessor``,
    PIL backend: resizes to multiples of ``patch * merge`` within ``max_pixels``) and
    ``chat_template.jinja`` of a Qwen processor in ``d``, beside its tokenizer."""
    import transformers
    transformers.Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=temporal, merge_size=merge,
                                          min_pixels=(patch * merge) ** 2, max_pixels=max_pixels
                                          ).save_pretrained(str(d))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": processor,
                                                          "image_token": "<|image_pad|>"}))
    (d / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)


def make_qwen_vl_processor(d, **kw):
    """A tiny Qwen processor's files in ``d``: a byte-level tokenizer with :data:`QWEN_VL_SPECIALS`
    (``<|endoftext|>`` its end of sequence and padding, as Qwen's base tokenizers: documents end there, not
    at each turn's ``<|im_end|>``) and :func:`write_qwen_vl_processor_files`."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_VL_SPECIALS])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>",
                                               pad_token="<|endoftext|>")
    tok.save_pretrained(str(d))
    write_qwen_vl_processor_files(d, **kw)


#: the tiny GLM-4V processor's special tokens, in id order after the 256 bytes (<|image|> is id 262)
GLM4V_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|begin_of_image|>", "<|image|>",
                  "<|end_of_image|>"]
#: GLM-4V's chat template's shape: [gMASK]<sop>, <|role|> turns, each image between its begin and end markers
GLM4V_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{% if m.content is string %}{{ m.content }}"
                  "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<|begin_of_image|><|image|>"
                  "<|end_of_image|>{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}{% endfor %}")


def write_glm4v_processor_files(d, patch=4, merge=2, temporal=2, max_pixels=1024, processor="Glm4vProcessor"):
    """``processor_config.json``, ``preprocessor_config.json`` (the real ``Glm4vImageProcessor``, PIL
    backend: resizes to multiples of ``patch * merge`` within ``max_pixels``) and
    ``chat_template.jinja`` of a GLM-4V processor in ``d``, beside its tokenizer."""
    import transformers
    transformers.Glm4vImageProcessorPil(patch_size=patch, temporal_patch_size=temporal, merge_size=merge,
                                        size={"shortest_edge": (patch * merge) ** 2, "longest_edge": max_pixels}
                                        ).save_pretrained(str(d))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
    (d / "chat_template.jinja").write_text(GLM4V_TEMPLATE)


def make_glm4v_processor(d, **kw):
    """A tiny GLM-4V processor's files in ``d``: a byte-level tokenizer with :data:`GLM4V_SPECIALS`
    (``<|endoftext|>`` its end of sequence and padding) and :func:`write_glm4v_processor_files`."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in GLM4V_SPECIALS])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>",
                                               pad_token="<|endoftext|>")
    tok.save_pretrained(str(d))
    write_glm4v_processor_files(d, **kw)


#: the tiny LLaVA processor's special tokens, in id order after the 256 bytes (<image> is id 258)
LLAVA_SPECIALS = ["<s>", "</s>", "<image>", "<pad>"]
#: LLaVA-1.5's chat template (its processor's): USER / ASSISTANT turns, each image as <image> and a newline
LLAVA_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
                  "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
                  "{% if c.type == 'image' %}<image>\n{% endif %}{% endfor %}{% for c in m.content %}"
                  "{% if c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}"
                  "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %} {% endfor %}")


def make_llava_processor(d, patch=4, image_size=8, strategy="default"):
    """A tiny LLaVA-1.5 processor's files in ``d`` (as ``LlavaProcessor.save_pretrained`` writes them):
    a byte-level tokenizer with ``<image>`` (id 258), the real ``CLIPImageProcessor`` (PIL backend)
    resizing the shortest edge to ``image_size`` and cropping the centre square,
    ``processor_config.json`` (one additional image token: the class token's) and
    :data:`LLAVA_TEMPLATE`."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAVA_SPECIALS])
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                         pad_token="<pad>").save_pretrained(str(d))
    write_llava_processor_files(d, patch, image_size, strategy)


def write_llava_processor_files(d, patch, image_size, strategy):
    """``processor_config.json``, ``preprocessor_config.json`` (the real ``CLIPImageProcessor``, PIL
    backend) and ``chat_template.jinja`` of a LLaVA-1.5 processor in ``d``, beside its tokenizer."""
    import transformers
    transformers.CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                       crop_size={"height": image_size, "width": image_size}).save_pretrained(str(d))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": patch, "image_token": "<image>",
        "num_additional_image_tokens": 1, "vision_feature_select_strategy": strategy}))
    (d / "chat_template.jinja").write_text(LLAVA_TEMPLATE)


def write_llama4_processor_files(d, patch, image_size, template, max_patches=16):
    """``processor_config.json``, ``preprocessor_config.json`` (``Llama4ImageProcessor``'s settings: tiles of
    ``image_size``) and ``chat_template.jinja`` of a Llama 4 processor in ``d``, beside its tokenizer."""
    (d / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Llama4ImageProcessor", "size": {"height": image_size, "width": image_size},
        "max_patches": max_patches, "resize_to_max_canvas": False, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    (d / "processor_config.json").write_text(json.dumps({
        "processor_class": "Llama4Processor", "patch_size": patch, "pixel_shuffle_ratio": 0.5,
        "image_token": "<|image|>", "patch_token": "<|patch|>"}))
    (d / "chat_template.jinja").write_text(template)
#: the tiny LFM2-VL processor's special tokens, in id order after the 256 bytes (<image> is id 261)
LFM2_VL_SPECIALS = ["<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|image_start|>", "<image>",
                    "<|image_end|>", "<|img_thumbnail|>",
                    *(f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5))]
#: LFM2-VL's chat template, shortened: ChatML turns, each image as <image> before the turn's text
LFM2_VL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
                    "{% if c.type == 'image' %}<image>{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}"
                    "{% endif %}<|im_end|>\n{% endfor %}")


def make_lfm2_vl_processor(d, patch=4, merge=2, tile=16, max_tokens=4):
    """A tiny LFM2-VL processor's files in ``d`` (as ``Lfm2VlProcessor.save_pretrained`` writes them): a
    byte-level tokenizer with :data:`LFM2_VL_SPECIALS`, ``preprocessor_config.json`` (images of up to
    ``max_tokens`` tokens whole, larger ones in ``tile``-pixel tiles and a thumbnail) and the template."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LFM2_VL_SPECIALS])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|startoftext|>", eos_token="<|im_end|>",
                                               pad_token="<|pad|>")
    tok.save_pretrained(str(d))
    write_lfm2_vl_processor_files(d, patch, merge, tile, max_tokens)


def write_lfm2_vl_processor_files(d, patch=4, merge=2, tile=16, max_tokens=4):
    """``preprocessor_config.json``, ``processor_config.json`` and ``chat_template.jinja`` of a tiny
    LFM2-VL processor in ``d``, beside its tokenizer (:func:`make_lfm2_vl_processor`)."""
    (d / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Lfm2VlImageProcessor", "downsample_factor": merge, "encoder_patch_size": patch,
        "tile_size": tile, "min_image_tokens": 1, "max_image_tokens": max_tokens, "min_tiles": 2, "max_tiles": 4,
        "max_pixels_tolerance": 2.0, "do_image_splitting": True, "use_thumbnail": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor"}))
    (d / "chat_template.jinja").write_text(LFM2_VL_TEMPLATE)


#: the tiny InternVL processor's special tokens, in id order after the 256 bytes (<IMG_CONTEXT> is id 261)
INTERNVL_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
#: InternVL's chat template, shortened: ChatML turns, each image as <IMG_CONTEXT> and a newline first
INTERNVL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                     "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
                     "{% if c.type == 'image' %}<IMG_CONTEXT>\n{% endif %}{% endfor %}{% for c in m.content %}"
                     "{% if c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")


def make_internvl_processor(d, image_size=16, seq=4, max_patches=4):
    """A tiny InternVL processor's files in ``d``: a byte-level tokenizer with :data:`INTERNVL_SPECIALS` (its
    ``tokenizer_config.json`` naming the image markers, as the ``-HF`` repositories'), the real
    ``GotOcr2ImageProcessor`` (PIL backend: tiles of ``image_size`` pixels, up to ``max_patches`` and a
    thumbnail), ``image_seq_length`` ``seq`` and the template."""
    write_internvl_tokenizer(d)
    write_internvl_processor_files(d, image_size, seq, max_patches)


def write_internvl_tokenizer(d):
    """The tiny InternVL tokenizer (:data:`INTERNVL_SPECIALS`) in ``d``, its config naming the image markers."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in INTERNVL_SPECIALS])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.save_pretrained(str(d))
    conf = json.loads((d / "tokenizer_config.json").read_text())
    conf["extra_special_tokens"] = {"start_image_token": "<img>", "end_image_token": "</img>",
                                    "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))


def write_internvl_processor_files(d, image_size=16, seq=4, max_patches=4):
    """``preprocessor_config.json``, ``processor_config.json`` and ``chat_template.jinja`` of a tiny InternVL
    processor in ``d``, beside its tokenizer."""
    import transformers
    transformers.GotOcr2ImageProcessorPil(size={"height": image_size, "width": image_size}, crop_to_patches=True,
                                          min_patches=1, max_patches=max_patches).save_pretrained(str(d))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "InternVLProcessor",
                                                          "image_seq_length": seq}))
    (d / "chat_template.jinja").write_text(INTERNVL_TEMPLATE)


#: the tiny PaddleOCR-VL processor's special tokens, in id order after the 256 bytes (<|IMAGE_PLACEHOLDER|> is 258)
PADDLEOCR_VL_SPECIALS = ["<|endoftext|>", "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>"]
#: a chat template rendering an image entry as PaddleOCR-VL's IMAGE_START, IMAGE_PLACEHOLDER, IMAGE_END
PADDLEOCR_VL_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
                         "{% for c in m.content %}{% if c.type == 'image' %}<|IMAGE_START|><|IMAGE_PLACEHOLDER|>"
                         "<|IMAGE_END|>{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}")


def make_paddleocr_vl_processor(d, patch=4, merge=2, max_pixels=1024):
    """A tiny PaddleOCR-VL processor's files in ``d``: a byte-level tokenizer with
    :data:`PADDLEOCR_VL_SPECIALS`, the real ``PaddleOCRVLImageProcessor`` (PIL backend: resizes to
    multiples of ``patch * merge`` within ``max_pixels``, raster-ordered patches), its chat template."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in PADDLEOCR_VL_SPECIALS])
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>",
                                         pad_token="<|endoftext|>").save_pretrained(str(d))
    write_paddleocr_vl_processor_files(d, patch, merge, max_pixels)


def write_paddleocr_vl_processor_files(d, patch=4, merge=2, max_pixels=1024):
    """``processor_config.json``, ``preprocessor_config.json`` (PIL backend) and ``chat_template.jinja``
    of a PaddleOCR-VL processor in ``d``, beside its tokenizer."""
    import transformers
    transformers.PaddleOCRVLImageProcessorPil(patch_size=patch, merge_size=merge, min_pixels=(patch * merge) ** 2,
                                              max_pixels=max_pixels).save_pretrained(str(d))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "PaddleOCRVLProcessor"}))
    (d / "chat_template.jinja").write_text(PADDLEOCR_VL_TEMPLATE)
