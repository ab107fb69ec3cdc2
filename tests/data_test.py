"""
Tests of the data path (CPU, tiny LLaMA, bundled data, byte-level tokenizer):

* a packed row gives each example the same loss and the same gradients as that
  example run alone, with HF's path and with every Triton kernel switched in
  (positions restart per example, attention never crosses examples, the first
  token of an example is never a target);
* the labels mask the prompt: the loss sees the response (and EOS) only; with a
  tokenizer's chat template too (a real transformers tokenizer built offline), and
  a template that rewrites the prompt once the answer follows is refused;
* packing cuts the padding of the bundled data by more than half;
* Dolly and Alpaca field names, JSON, JSON Lines and Parquet files all load;
* bad input ends in one line before any model is built (or, for --eval-every
  without held-out examples, before any training);
* --dataset synthetic trains exactly as the loop did before real data existed;
* the batches are a pure function of (seed, step), with or without workers; the
  held-out split is fixed and disjoint from the training examples.

Usage:
    python -m pytest tests/data_test.py -v
    python tests/data_test.py
"""

if __name__ == "__main__":
    # `python tests/data_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import json
import sys

import pytest
import torch

from kernel_ft import dataloader
import finetune_baseline
import finetune_optimized
from kernel_ft import flags, models, run, training

IGNORE = dataloader.IGNORE_INDEX


def tiny_model():
    args = flags.settle(finetune_baseline.parse_args(["--tiny", "--seq-len", "32"]))
    model, _ = models.load_model(args)
    return model


def toy_examples():
    """Three short examples: a few prompt tokens (label IGNORE), then response tokens.
    Lengths 9 + 12 + 6 = 27 tokens, so a row of 32 also has a padding tail of 5."""
    gen = torch.Generator().manual_seed(1)
    examples = []
    for prompt_len, response_len in ((4, 5), (7, 5), (2, 4)):
        ids = torch.randint(3, 259, (prompt_len + response_len,), generator=gen).tolist()
        examples.append((ids, [IGNORE] * prompt_len + ids[prompt_len:]))
    return examples


def only_example(batch, keep, starts_and_lengths):
    """The packed batch with the labels of every example but ``keep`` ignored."""
    labels = torch.full_like(batch["labels"], IGNORE)
    start, length = starts_and_lengths[keep]
    labels[0, start: start + length] = batch["labels"][0, start: start + length]
    return dict(batch, labels=labels)


def loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, dataloader.batch_to(batch, next(model.parameters()).device))
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("path", ["hf", "all kernels"])
def test_packed_row_equals_examples_one_by_one(path, capsys):
    model = tiny_model()
    loss_fn = training.hf_loss
    if path == "all kernels":
        loss_fn, _ = run.apply_kernels(model, {name: True for name in flags.KERNELS})
        assert "fused RoPE in 2 attention modules" in capsys.readouterr().out
    examples = toy_examples()
    packed = dataloader.StepBatches(examples, 1, 32, packing=True, seed=0, pad_id=0).collate([[0, 1, 2]])
    alone = dataloader.StepBatches(examples, 1, 32, packing=False, seed=0, pad_id=0)
    assert packed["input_ids"].shape == (1, 32) and packed["num_real_tokens"] == 27
    assert packed["position_ids"][0].tolist() == list(range(9)) + list(range(12)) + list(range(6)) + list(range(5))
    spans = [(0, 9), (9, 12), (21, 6)]
    for i, (start, _) in enumerate(spans):
        assert packed["labels"][0, start] == IGNORE  # never predicted from the previous example
        single = alone.collate([[i]])
        assert single["input_ids"].shape == (1, len(examples[i][0])) and single["attention_mask"].all()
        loss_one, grads_one = loss_and_grads(model, loss_fn, single)
        loss_packed, grads_packed = loss_and_grads(model, loss_fn, only_example(packed, i, spans))
        assert abs(loss_one - loss_packed) < 1e-5, f"example {i}: alone {loss_one:.6f}, packed {loss_packed:.6f}"
        for g1, gp in zip(grads_one, grads_packed):
            torch.testing.assert_close(gp, g1, rtol=1e-4, atol=1e-6)
    if path == "hf":
        # The test has teeth: without the block mask and the restarted positions the
        # third example sees the other two, and its loss changes.
        leaky = dict(only_example(packed, 2, spans), attention_mask=None, position_ids=None)
        assert abs(loss_and_grads(model, loss_fn, leaky)[0] - loss_one) > 1e-3


def test_packed_row_under_eager_attention_equals_examples_one_by_one():
    """transformers' eager attention (Gemma-2's, and any family without SDPA) adds a ready
    4-D mask to the scores as it is: the packed rows' mask must be additive there
    (models.mask_dtype). A bool one adds 1 and 0 and hides nothing, so the examples would
    attend to each other (the test checks that too)."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    assert models.mask_dtype(model) == torch.float32
    examples, spans = toy_examples(), [(0, 9), (9, 12), (21, 6)]
    alone = dataloader.StepBatches(examples, 1, 32, packing=False, seed=0, pad_id=0)
    loss_one = loss_and_grads(model, training.hf_loss, alone.collate([[2]]))[0]
    for dtype, leaks in ((models.mask_dtype(model), False), (None, True)):
        packed = dataloader.StepBatches(examples, 1, 32, packing=True, seed=0, pad_id=0,
                                        mask_dtype=dtype).collate([[0, 1, 2]])
        loss_packed = loss_and_grads(model, training.hf_loss, only_example(packed, 2, spans))[0]
        assert (abs(loss_one - loss_packed) > 1e-3) == leaks, (dtype, loss_one, loss_packed)


def test_labels_mask_the_prompt():
    tok = dataloader.ByteTokenizer()
    record = {"instruction": "Name a primary colour.", "context": "Colours of paint.", "response": "Red."}
    ids, labels = dataloader.encode_record(tok, record)
    prompt = "### Instruction:\nName a primary colour.\n\n### Context:\nColours of paint.\n\n### Response:\n"
    n_prompt = 1 + len(prompt.encode())  # BOS + the template
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:n_prompt]) == prompt
    assert labels[:n_prompt] == [IGNORE] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:] and tok.decode(labels[n_prompt:]) == "Red."
    assert labels[-1] == tok.eos_token_id
    no_context = dataloader.encode_record(tok, dict(record, context=""))[0]
    assert tok.decode(no_context) == "### Instruction:\nName a primary colour.\n\n### Response:\nRed."


def bundled_padding(packing, seq_len, batch_size=2):
    """Padding fraction of one epoch of the bundled data (byte-level tokens)."""
    train, _ = dataloader.split_records(dataloader.load_records(flags.BUNDLED_DATASET))
    examples, _, _ = dataloader.encode_records(dataloader.ByteTokenizer(), train, seq_len)
    batches = dataloader.StepBatches(examples, batch_size, seq_len, packing, seed=0, pad_id=0)
    slots = real = 0
    for step in range(batches.num_batches()):
        batch = batches[step]
        slots, real = slots + batch["num_tokens"], real + batch["num_real_tokens"]
    return 1 - real / slots


def chat_tokenizer(template):
    """A real transformers tokenizer, built offline: one token per character (byte
    values), end of turn = chr(4), and ``template`` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={chr(i): i for i in range(256)}, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="?", eos_token="\x04")
    tokenizer.chat_template = template
    return tokenizer


CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\x04{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_template_labels_the_answer_only():
    """A tokenizer with a chat template: the user turn (instruction, then context)
    and the assistant header are the prompt; the answer and its end-of-turn token
    are the labels."""
    record = {"instruction": "Name a color.", "context": "Sky at noon.", "response": "Blue."}
    ids, labels = dataloader.encode_record(chat_tokenizer(CHAT), record)
    text = "".join(map(chr, ids))
    assert text == "<user>Name a color.\n\nSky at noon.\x04<assistant>Blue.\x04"
    answer = [i for i, label in zip(ids, labels) if label != dataloader.IGNORE_INDEX]
    assert "".join(map(chr, answer)) == "Blue.\x04"
    assert labels[: len(ids) - len(answer)] == [dataloader.IGNORE_INDEX] * (len(ids) - len(answer))


def test_chat_template_that_rewrites_the_prompt_is_refused():
    """A template whose prompt changes once the answer follows (here: it counts the
    turns) leaves no clean boundary: one line, no silent mislabelling."""
    counting = "{{ messages | length }}" + CHAT
    with pytest.raises(SystemExit, match="chat template writes the prompt differently"):
        dataloader.encode_record(chat_tokenizer(counting), {"instruction": "Hi", "context": "", "response": "Yo"})


def test_packing_cuts_padding_by_more_than_half():
    # 1024 bytes: most examples fit whole, as most fit in 2048 BPE tokens on a GPU.
    # (At the CPU default of 128 bytes nearly every example is cut to the full
    # row, so padding has little to waste there.)
    padded, packed = bundled_padding(False, 1024), bundled_padding(True, 1024)
    print(f"padding fraction at 2 x 1024: padded {padded:.3f}, packed {packed:.3f}")
    assert packed < padded / 2


def test_bundled_data_is_varied():
    records = dataloader.load_records(flags.BUNDLED_DATASET)
    assert len(records) >= 300
    lengths = sorted(len(dataloader.encode_record(dataloader.ByteTokenizer(), r)[0]) for r in records)
    assert lengths[len(lengths) // 2] < 400  # many short ones ...
    assert sum(n > 3500 for n in lengths) >= 5  # ... and a tail of long ones (~1,000 BPE tokens or more)


def test_run_reports_padding_and_real_tokens(tmp_path, capsys):
    path = tmp_path / "run.json"
    finetune_baseline.main(["--tiny", "--seq-len", "512", "--steps", "2", "--warmup-steps", "0", "--json", str(path)])
    doc = json.loads(path.read_text())
    assert 0 < doc["padding_fraction"] < 1 and 0 < doc["real_tokens_per_sec"] < doc["tokens_per_sec"]
    # Loader workers: 2 by default on a GPU machine, 0 without one (the interpreter is the bottleneck).
    assert doc["config"]["packing"] is False and doc["config"]["num_workers"] == (2 if torch.cuda.is_available() else 0)
    out = capsys.readouterr().out
    assert "Data:          bundled data/instructions.jsonl:" in out
    assert "Real tokens (no padding):" in out and "% of the token slots)" in out


def test_profile_uses_the_same_data_path(tmp_path, capsys):
    import profile_baseline

    summary = profile_baseline.main(["--tiny", "--seq-len", "256", "--trace-dir", str(tmp_path)])
    assert summary["setup"]["dataset"] == "bundled data/instructions.jsonl" and summary["setup"]["packing"] is False
    assert "Data:          bundled data/instructions.jsonl:" in capsys.readouterr().out


# --------------------------------------------------------------------------------
# Files and field names
# --------------------------------------------------------------------------------
DOLLY = [{"instruction": "Say hi.", "context": "", "response": "Hi!", "category": "open_qa"},
         {"instruction": "Add.", "context": "2 and 3", "response": "5"}]
ALPACA = [{"instruction": "Say hi.", "input": "", "output": "Hi!"},
          {"instruction": "Add.", "input": "2 and 3", "output": "5"}]
EXPECTED = [{"instruction": "Say hi.", "context": "", "response": "Hi!"},
            {"instruction": "Add.", "context": "2 and 3", "response": "5"}]


def write(path, rows, kind):
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("names, rows", [("dolly", DOLLY), ("alpaca", ALPACA)])
def test_field_names_and_file_formats(tmp_path, kind, names, rows):
    path = write(tmp_path / f"{names}.{kind}", rows, kind)
    assert dataloader.load_records(path) == EXPECTED


def test_json_lines_in_a_json_file(tmp_path):
    assert dataloader.load_records(write(tmp_path / "dolly.json", DOLLY, "jsonl")) == EXPECTED


@pytest.mark.parametrize("rows, message", [
    (None, "no such file"),
    ([{"question": "q", "answer": "a"}], "record 1 has fields ['answer', 'question']; expected instruction and"),
    (DOLLY + [{"instruction": "Say nothing.", "response": "  "}], "record 3 has an empty response"),
    ([], "no records in it"),
])
def test_bad_dataset_fails_in_one_line_before_the_model(tmp_path, monkeypatch, capsys, rows, message):
    monkeypatch.setattr(models, "load_model", lambda *a: pytest.fail("built a model before checking the data"))
    path = tmp_path / "data.jsonl"
    if rows is not None:
        write(path, rows, "jsonl")
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(["--tiny", "--dataset", str(path), "--steps", "1"])
    text = str(e.value.code)
    assert text.startswith(f"error: --dataset {path}") and message in text and "\n" not in text


def test_eval_without_held_out_examples_is_refused(tmp_path, monkeypatch):
    # Two records: 5% of them is none, so there is nothing to evaluate on.
    monkeypatch.setattr(training, "train_step", lambda *a, **k: pytest.fail("trained before the check"))
    path = write(tmp_path / "dolly.jsonl", DOLLY, "jsonl")
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(["--tiny", "--dataset", path, "--steps", "1", "--eval-every", "1"])
    text = str(e.value.code)
    assert text.startswith("error: --eval-every:") and "no held-out example" in text and "\n" not in text


def test_hub_dataset_offline(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as e:
        dataloader.load_records("databricks/databricks-dolly-15k")
    text = str(e.value.code)
    assert "not a local file, and the HF hub cannot serve it (HF_HUB_OFFLINE is set" in text and "\n" not in text


def test_too_short_seq_len_is_refused():
    args = flags.settle(finetune_baseline.parse_args(["--tiny", "--seq-len", "8"]))
    with pytest.raises(SystemExit) as e:
        dataloader.prepare_data(args, dataloader.load_records(args.dataset), 8192)
    assert "--seq-len 8 leaves no response token in any training example" in str(e.value.code)


def no_training(monkeypatch):
    monkeypatch.setattr(training, "train_step", lambda *a, **k: pytest.fail("trained on steps with nothing to learn"))


@pytest.mark.parametrize("script", [finetune_baseline, finetune_optimized])
def test_tokenizer_that_encodes_nothing_is_refused(script, tmp_path, monkeypatch):
    # A vocabulary-less tokenizer, what transformers builds for a folder that holds
    # a config but no tokenizer files: every text becomes [].
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    models.tiny_config().save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE())).save_pretrained(tmp_path)
    no_training(monkeypatch)
    with pytest.raises(SystemExit) as e:
        script.main(["--model", str(tmp_path), "--no-tiny", "--seq-len", "64", "--steps", "1"])
    assert e.value.code == f"error: the tokenizer of {tmp_path} turns text into no tokens (are its tokenizer files missing?)"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
def test_a_model_folder_without_tokenizer_files_gets_the_byte_tokenizer(model_type, tmp_path):
    # transformers raises for some families (LLaMA) and builds an empty tokenizer from the
    # config for others (Qwen2: no tokens; Gemma-2: its unknown token only): bytes for all.
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, vocab_size=320).save_pretrained(tmp_path)
    args = flags.settle(finetune_baseline.parse_args(["--model", str(tmp_path), "--no-tiny"]))
    tokenizer, description = dataloader.load_tokenizer(args)
    assert isinstance(tokenizer, dataloader.ByteTokenizer) and "unavailable" in description


@pytest.mark.parametrize("script", [finetune_baseline, finetune_optimized])
def test_synthetic_rows_of_one_token_are_refused(script, monkeypatch):
    no_training(monkeypatch)
    with pytest.raises(SystemExit) as e:
        script.main(["--tiny", "--dataset", "synthetic", "--seq-len", "1", "--steps", "1"])
    assert e.value.code == ("error: --dataset synthetic with --seq-len 1: each position learns the next token, "
                            "so a row needs at least 2 tokens")


class NoEosTokenizer(dataloader.ByteTokenizer):
    eos_token_id = None  # an empty response then has no token at all


def test_examples_without_a_target_are_left_out():
    empty = {"instruction": "Say nothing.", "context": "", "response": ""}
    full = {"instruction": "Say yes.", "context": "", "response": "yes"}
    examples, cut, lost = dataloader.encode_records(NoEosTokenizer(), [empty, full, empty], 64)
    assert (cut, lost) == (0, 2)
    assert examples == [dataloader.encode_record(NoEosTokenizer(), full)]
    # Every kept example has a label after its first token, so every row of a batch has a target.
    assert all(dataloader.has_target(labels) for _, labels in examples)


def test_data_with_nothing_to_learn_is_refused(monkeypatch):
    monkeypatch.setattr(dataloader, "load_tokenizer", lambda args: (NoEosTokenizer(), "bytes without EOS"))
    args = flags.settle(finetune_baseline.parse_args(["--tiny", "--seq-len", "64"]))
    records = [{"instruction": f"Question {i}?", "context": "", "response": ""} for i in range(40)]
    with pytest.raises(SystemExit) as e:
        dataloader.prepare_data(args, records, 8192)
    assert e.value.code == ("error: no training example of bundled data/instructions.jsonl has a response token to learn "
                            "(are the responses empty?)")


# --------------------------------------------------------------------------------
# Synthetic data: the same training as before real data existed
# --------------------------------------------------------------------------------
def test_synthetic_keeps_the_old_losses():
    # No clipping and no lr warm-up: the first update is the old loop's exactly.
    argv = ["--tiny", "--dataset", "synthetic", "--seq-len", "32", "--steps", "2", "--warmup-steps", "1",
            "--lr", "1e-3", "--max-grad-norm", "0", "--lr-warmup-steps", "0"]
    new = finetune_baseline.main(argv)["losses"]
    # The loop as it was written before --dataset: synthetic_batches' (ids, ids)
    # straight into the model, HF's loss, PyTorch's AdamW (stepped by the schedule).
    args = flags.settle(finetune_baseline.parse_args(argv))
    model, _ = models.load_model(args)
    optimizer = training.pytorch_adamw(model.parameters(), lr=args.lr)
    scheduler = training.make_scheduler(optimizer, args)
    batches = dataloader.synthetic_batches(2, 32, model.config.vocab_size, args.seed, next(model.parameters()).device)
    old = []
    for _ in range(3):
        input_ids, labels = next(batches)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        old.append(loss.item())
    assert new == old
    # And the losses the code before the data path gave for these flags (its
    # finetune_baseline.py --json output, recorded; constant lr 1e-3 then, so
    # only the losses before and after the first update, at the full rate, compare).
    recorded = [9.121954917907715, 9.044489860534668, 8.94786548614502]  # on CPU: a GPU draws other weights
    if not torch.cuda.is_available():
        assert max(abs(a - b) for a, b in zip(new[:2], recorded[:2])) < 1e-5


# --------------------------------------------------------------------------------
# Determinism: batch k is a function of (seed, k); the held-out split is fixed
# --------------------------------------------------------------------------------
def same_batch(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("packing", [False, True])
def test_batches_resume_at_any_step(packing):
    args = flags.settle(finetune_baseline.parse_args(["--tiny", "--batch-size", "4"]))
    args = args.but(packing=packing)
    data = dataloader.prepare_data(args, dataloader.load_records(args.dataset), 8192)
    cpu = torch.device("cpu")
    stream = dataloader.training_batches(args, data, cpu, 8192)
    first = [next(stream) for _ in range(90)]  # beyond one epoch
    assert all(len(step) == 1 for step in first)  # one micro-batch per step without --grad-accum
    first = [step[0] for step in first]
    resumed = dataloader.training_batches(args, data, cpu, 8192, start_step=85)
    for step in range(85, 90):
        same_batch(first[step], next(resumed)[0])
    assert first[0]["input_ids"].tolist() != first[1]["input_ids"].tolist()
    # --grad-accum 2: step k holds micro-batches 2k and 2k + 1 of the same stream.
    accumulated = next(dataloader.training_batches(args.but(grad_accum=2), data, cpu, 8192, start_step=40))
    same_batch(first[80], accumulated[0])
    same_batch(first[81], accumulated[1])
    if packing:  # worker processes build the same batches, in the same order
        with_workers = dataloader.training_batches(args.but(num_workers=2), data, cpu, 8192, start_step=3)
        for step in range(3, 6):
            same_batch(first[step], next(with_workers)[0])


def test_synthetic_resumes_at_any_step():
    args = flags.settle(finetune_baseline.parse_args(["--tiny", "--dataset", "synthetic"]))
    cpu = torch.device("cpu")
    stream = dataloader.training_batches(args, None, cpu, 8192)
    first = [next(stream)[0] for _ in range(4)]
    same_batch(first[3], next(dataloader.training_batches(args, None, cpu, 8192, start_step=3))[0])
    same_batch(first[3], next(dataloader.training_batches(args.but(grad_accum=2), None, cpu, 8192, start_step=1))[1])


def test_held_out_split():
    records = dataloader.load_records(flags.BUNDLED_DATASET)
    train, held = dataloader.split_records(records)
    assert len(held) == int(len(records) * dataloader.EVAL_FRACTION) and len(train) + len(held) == len(records)
    assert not {json.dumps(r) for r in held} & {json.dumps(r) for r in train}
    assert dataloader.split_records(records) == (train, held)
    args = flags.settle(finetune_baseline.parse_args(["--tiny", "--seed", "7", "--packing"]))
    data = dataloader.prepare_data(args, records, 8192)
    assert len(data.held_out) <= len(held) and len(data.train) <= len(train)
    batches = dataloader.held_out_batches(args.but(eval_batches=None), data,  # all of them
                                          torch.device("cpu"), 8192)
    assert sum(b["num_real_tokens"] for b in batches) == sum(len(ids) for ids, _ in data.held_out)
    # --eval-batches 2: the first two, the same at every evaluation
    first_two = dataloader.held_out_batches(args.but(eval_batches=2), data, torch.device("cpu"), 8192)
    assert len(batches) > 2 and len(first_two) == 2
    for a, b in zip(first_two, batches):
        same_batch(a, b)


@pytest.mark.parametrize("name, holds", [("tekken.json", True), ("tokenizer.model.v3", True), ("tiktoken.model", True),
                                         ("spm.model", True), ("generation_config.json", False)])
def test_the_tokenizer_files_a_model_folder_is_read_by(name, holds, tmp_path):
    # Mistral's tekken.json and versioned tokenizer.model.v3, tiktoken and SentencePiece
    # files are tokenizers transformers loads: such a folder keeps its own, never bytes.
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / name).write_text("")
    assert dataloader.holds_tokenizer(tmp_path) is holds
