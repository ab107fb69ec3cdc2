"""
The data: instruction records -> prompt + response tokens -> padded or packed
batches, or synthetic tokens for pure throughput runs.

README Step 2 (``--dataset``) and Step 18 (your own data, packing). What it teaches:

* Records (``load_records``): the bundled instruction set (data/instructions.jsonl),
  a local .json/.jsonl/.parquet file or a hub dataset, read as
  instruction + optional context + response (Dolly's or Alpaca's field names).
  A malformed file ends in one line that names the record and the field.
* Tokens (``load_tokenizer``, ``encode_record``): the model's own tokenizer and its
  chat template when it has one, else a plain "### Instruction / ### Response"
  prompt; without a tokenizer (``--tiny``) every byte is a token. The loss is on
  the response only: prompt tokens get the label IGNORE_INDEX.
* Batches (``StepBatches``): padding puts one example per row and pads to the
  longest (as HF's collator does: every padding slot is computed and thrown away);
  packing fills each row with several examples end to end, restarts the positions
  at every example and gives attention a block-diagonal causal mask, so an example
  attends only to itself. Packing is what turns padding into real tokens per
  second (Step 18's table).
* Reproducible order (``training_batches``): a step's batches are a pure function of
  the seed and the step number, so a resumed run sees exactly the batches the
  uninterrupted run would have seen; worker processes build them ahead of the GPU.
* Held-out batches (``held_out_batches``) for ``--eval-every``: a fixed 5% of the
  records, the same whatever ``--seed``.

Nothing runs on import.
"""

import contextlib
import itertools
import json
import os
import random

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

import torch
import torch.nn.functional as F
from swap_common import additive_mask, error_line, evaluating

from kernel_ft import files, flags, models, fsdp

IGNORE_INDEX = -100  # HF's label value for "no loss at this position"


# --------------------------------------------------------------------------------
# Data: instruction records -> prompt + response tokens -> padded or packed batches
#
# One batch is a dict (the only format the losses and the training loop know):
#   input_ids       [B, T] int64   token ids; padding slots hold the pad id
#   labels          [B, T] int64   the token to learn at each position, IGNORE_INDEX
#                                  on prompt tokens, padding and each example's first
#                                  token (the loss functions shift them by one)
#   position_ids    [B, T] int64 or None   packing: restart at 0 in every example;
#                                  None: the model counts 0, 1, 2, ... itself
#   attention_mask  None, [B, T] (1 = real token, padding) or [B, 1, T, T] bool
#                   (packing: True where query t may attend to key s; None with the
#                   attention kernel, which reads the examples from position_ids)
#   num_tokens      int: B * T, the token slots the model computes
#   num_real_tokens int: the slots that hold real tokens, not padding
# The two counts are Python ints, known without asking the GPU (no sync).
# A training step is a list of --grad-accum such batches, its micro-batches
# (training_batches); the losses and evaluate() take one batch at a time.
# --------------------------------------------------------------------------------
def shift_labels(labels):
    """Targets for causal LM: position t predicts token t+1; the last position predicts nothing.

    [B, T] -> [B, T]: shifted left by one and padded with IGNORE_INDEX, so a loss
    can use the model's [B, T, V] logits whole (no slice, no .contiguous() copy of
    the largest tensor of the step). Only the small int64 labels are copied.
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


# --------------------------------------------------------------------------------
# Synthetic data: fixed-length random tokens, for pure throughput runs
# --------------------------------------------------------------------------------
def synthetic_batches(batch_size, seq_len, vocab_size, seed, device):
    """Endless seeded token batches: the same seed gives every script the same data.

    Tokens are drawn with Zipf frequencies (token k about 1/(k+1) as often as the
    most common one), like words in real text, and each sequence repeats a 16-token
    phrase. So there is something to learn (which tokens are common, then copying
    what came 16 tokens ago) and a falling loss shows that training works, without
    downloading a dataset.
    """
    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    phrase_len = min(16, seq_len)
    repeats = -(-seq_len // phrase_len)  # ceil
    while True:
        phrase = torch.multinomial(zipf, batch_size * phrase_len, replacement=True, generator=gen)
        ids = phrase.view(batch_size, phrase_len).repeat(1, repeats)[:, :seq_len].to(device)
        yield ids, ids  # labels are the inputs; the loss shifts them


# ---- Held-out data, the fields of a record, the prompt --------------------------
EVAL_SEED_OFFSET = 1_000_003  # synthetic held-out batches: the same generator with another seed
EVAL_FRACTION = 0.05  # share of the records held out for evaluation
SPLIT_SEED = "held-out split"  # fixed: the held-out records do not change with --seed

# Field names: Dolly-15k's first, then Alpaca's.
INSTRUCTION_FIELDS = ("instruction",)
CONTEXT_FIELDS = ("context", "input")
RESPONSE_FIELDS = ("response", "output")

# The prompt format when the tokenizer has no chat template (Alpaca/Dolly style).
# The loss is computed on the response that follows it, never on the prompt.
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_TEMPLATE_WITH_CONTEXT = "### Instruction:\n{instruction}\n\n### Context:\n{context}\n\n### Response:\n"


def lm_batch(input_ids, labels=None):
    """A batch of full rows of real tokens (no padding, no packing): the model's
    default positions and causal mask. Labels default to the inputs (the loss shifts)."""
    return {
        "input_ids": input_ids,
        "labels": input_ids if labels is None else labels,
        "position_ids": None,
        "attention_mask": None,
        "num_tokens": input_ids.numel(),
        "num_real_tokens": input_ids.numel(),
    }


def model_inputs(batch):
    """The keyword arguments of the model's forward that come from the batch."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}


def batch_to(batch, device):
    """Copy the batch's tensors to ``device``. non_blocking: from pinned host memory
    the copy runs asynchronously, so the CPU goes on queueing work meanwhile."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


# ---- Reading records ------------------------------------------------------------
def dataset_name(dataset):
    """How a --dataset value is printed: the bundled file by its path in the repo."""
    if dataset and os.path.abspath(dataset) == flags.BUNDLED_DATASET:
        return "bundled data/instructions.jsonl"
    return dataset


def load_records(dataset):
    """The records of --dataset as [{"instruction", "context", "response"}] (context may
    be ""), or None for ``synthetic``. Every problem ends the run here, in one line,
    before a model is built."""
    if dataset == flags.SYNTHETIC:
        return None
    flag = f"--dataset {dataset}"
    path = os.path.abspath(os.path.expanduser(dataset))
    is_file_name = dataset.lower().endswith((".json", ".jsonl", ".parquet"))
    if os.path.exists(path) or is_file_name or models.looks_like_path(dataset):
        files.check_input_file(path, "--dataset")
        rows = read_data_file(path, flag)
    else:
        rows = read_hub_dataset(dataset, flag)
    if not rows:
        raise SystemExit(f"error: {flag}: no records in it")
    return [instruction_record(row, number, flag) for number, row in enumerate(rows, start=1)]


def read_data_file(path, flag):
    """The rows of a .parquet file, a JSON array of objects, or JSON Lines (one
    object per line; a .json file that holds JSON Lines is read too)."""
    if not path.lower().endswith((".json", ".jsonl", ".parquet")):
        raise SystemExit(f"error: {flag}: expected a .json, .jsonl or .parquet file")
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet  # installed with datasets

        try:
            return pyarrow.parquet.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem
            raise SystemExit(f"error: {flag}: cannot read it as Parquet ({files.one_line(e)})") from None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {flag}: cannot read it ({files.one_line(e)})") from None
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except ValueError as e:
            raise SystemExit(f"error: {flag}: not valid JSON ({e})") from None
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise SystemExit(f"error: {flag}: line {line_number} is not valid JSON ({e})") from None
    return rows


def read_hub_dataset(name, flag):
    """The train split of a HF hub dataset, through the ``datasets`` library."""
    problem = models.hub_problem(name, repo_type="dataset")
    if problem:
        raise SystemExit(
            f"error: {flag}: not a local file, and the HF hub cannot serve it ({problem}); pass a local "
            f".json/.jsonl/.parquet file, or leave --dataset out for the bundled set"
        )
    import datasets

    try:
        return list(datasets.load_dataset(name, split="train"))
    except Exception as e:  # noqa: BLE001 - any loading problem is reported the same way
        raise SystemExit(f"error: {flag}: cannot load its train split ({files.one_line(e)})") from None


def instruction_record(row, number, flag):
    """One row as {"instruction", "context", "response"}, with Dolly or Alpaca names."""
    if not isinstance(row, dict):
        raise SystemExit(f"error: {flag}: record {number} is a {type(row).__name__}, expected an object")

    def field(names):
        return next((row[name] for name in names if row.get(name) is not None), None)

    instruction, context, response = field(INSTRUCTION_FIELDS), field(CONTEXT_FIELDS), field(RESPONSE_FIELDS)
    if instruction is None or response is None:
        raise SystemExit(
            f"error: {flag}: record {number} has fields {sorted(row)}; expected instruction and response "
            f"(Dolly: instruction, context, response; Alpaca: instruction, input, output)"
        )
    for name, value in (("instruction", instruction), ("context", context), ("response", response)):
        if value is not None and not isinstance(value, str):
            raise SystemExit(f"error: {flag}: record {number}: {name} is a {type(value).__name__}, expected text")
        if value is not None and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800"): no tokenizer can encode it
                raise SystemExit(f"error: {flag}: record {number}: {name} is not valid Unicode text "
                                 f"(an unpaired surrogate)") from None
    if not instruction.strip():
        raise SystemExit(f"error: {flag}: record {number} has an empty instruction")
    if not response.strip():
        raise SystemExit(f"error: {flag}: record {number} has an empty response")
    return {"instruction": instruction, "context": context or "", "response": response}


def split_records(records):
    """(train, held out): a fixed EVAL_FRACTION of the records, the same in every
    run whatever --seed, for the evaluation loop."""
    order = list(range(len(records)))
    random.Random(SPLIT_SEED).shuffle(order)
    held = set(order[: int(len(records) * EVAL_FRACTION)])
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


# ---- Tokenizing -----------------------------------------------------------------
class ByteTokenizer:
    """The tokenizer used when the model's own cannot be had (--tiny, offline):
    every UTF-8 byte of the text is one token.

    Ids 0, 1, 2 are PAD, BOS and EOS (the tiny config's bos/eos ids); byte b is id
    b + 3, so 259 ids in all, which any LLaMA vocabulary covers. No vocabulary
    file and no download; the price is 3-4 times more tokens than a BPE tokenizer
    needs for English text.
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    BYTE_OFFSET = 3
    vocab_size = 256 + BYTE_OFFSET
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        ids = [b + self.BYTE_OFFSET for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids):
        return bytes(i - self.BYTE_OFFSET for i in ids if i >= self.BYTE_OFFSET).decode("utf-8", errors="replace")

    def __len__(self):
        return self.vocab_size


# The files a saved tokenizer is made of (tokenizer.json for fast tokenizers; the others
# for slow ones, SentencePiece, BPE or tiktoken vocabularies, Mistral's tekken.json and
# versioned tokenizer.model.v3 ...); a model folder without any has none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "spm.model", "sentencepiece.model", "sentencepiece.bpe.model",
                   "tekken.json", "tiktoken.model")


def holds_tokenizer(folder):
    """Whether ``folder`` holds any of a saved tokenizer's files."""
    return any(f in TOKENIZER_FILES or f.startswith("tokenizer.model.v") for f in os.listdir(folder))


def load_tokenizer(args):
    """(tokenizer, description): the model's own tokenizer when it can be had, else
    the byte-level one (with a note saying why)."""
    if args.tiny:
        return ByteTokenizer(), "byte-level (--tiny)"
    from transformers import AutoTokenizer

    model_id, problem, tokenizer = args.model, None, None
    try:
        if os.path.isdir(model_id) and not holds_tokenizer(model_id):
            # A folder with a config and weights only: transformers would build some families an
            # empty tokenizer from the config (refuse_empty), others none at all. Bytes for all.
            problem = "its folder holds no tokenizer files"
        elif os.path.exists(model_id):
            return refuse_empty(AutoTokenizer.from_pretrained(model_id), model_id), f"{model_id}'s own"
        elif not models.looks_like_path(model_id):
            with contextlib.suppress(Exception):
                tokenizer = AutoTokenizer.from_pretrained(model_id, local_files_only=True)
            if tokenizer is not None:
                return refuse_empty(tokenizer, model_id), f"{model_id}'s own"
            problem = models.hub_problem(model_id)
            if problem is None:
                return refuse_empty(AutoTokenizer.from_pretrained(model_id), model_id), f"{model_id}'s own"
        else:
            problem = "no such file or directory"
    except Exception as e:  # noqa: BLE001 - any loading problem: fall back to bytes
        problem = files.one_line(e)
    flags.note(f"no tokenizer for {model_id} ({problem}): the byte-level tokenizer is used instead")
    return ByteTokenizer(), "byte-level (the model's own is unavailable)"


def refuse_empty(tokenizer, model_id):
    """``tokenizer``, refused if it turns text into no tokens. transformers builds such
    an empty tokenizer from a folder that has a config but no tokenizer files; a run
    with it would train on nothing (loss NaN or 0) and still exit 0."""
    ids = tokenizer.encode("Hello, world.", add_special_tokens=False)
    if not ids:
        raise SystemExit(f"error: the tokenizer of {model_id} turns text into no tokens (are its tokenizer "
                         f"files missing?)")
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and all(i == unknown for i in ids):
        raise SystemExit(f"error: the tokenizer of {model_id} turns plain English into its unknown token only "
                         f"(is it the model's own tokenizer?)")
    return tokenizer


def prompt_text(record):
    """The plain-template prompt of a record (it ends where the response begins)."""
    if record["context"].strip():
        return PROMPT_TEMPLATE_WITH_CONTEXT.format(**record)
    return PROMPT_TEMPLATE.format(**record)


def encode_record(tokenizer, record):
    """(ids, labels) of one record; labels are IGNORE_INDEX on the prompt.

    With a chat template: the prompt is the user turn plus the assistant header
    (add_generation_prompt), the response is what the full conversation adds to
    it. Without: PROMPT_TEMPLATE after BOS, then the response and EOS.
    """
    if getattr(tokenizer, "chat_template", None):
        user = record["instruction"] + (f"\n\n{record['context']}" if record["context"].strip() else "")
        turns = [{"role": "user", "content": user}]
        prompt = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        full = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": record["response"]}],
                                             tokenize=True, return_dict=False)
        if full[: len(prompt)] != prompt:
            raise SystemExit("error: the tokenizer's chat template writes the prompt differently once the "
                             "answer follows, so the response tokens cannot be told apart")
        response = full[len(prompt):]
    else:
        prompt = tokenizer.encode(prompt_text(record), add_special_tokens=True)  # BOS first, if it has one
        response = tokenizer.encode(record["response"], add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            response = response + [tokenizer.eos_token_id]  # so the model learns where an answer ends
    return prompt + response, [IGNORE_INDEX] * len(prompt) + response


def has_target(labels):
    """Whether an example has a token to learn. Its first token never counts: in a
    batch it would be predicted from whatever precedes the example (StepBatches)."""
    return any(label != IGNORE_INDEX for label in labels[1:])


def encode_records(tokenizer, records, seq_len):
    """Token examples [(ids, labels)], cut to ``seq_len``; also how many were cut,
    and how many are left out because they have no token to learn (a response
    lost to the cut, or none to begin with). So every row of every batch holds a
    target: no step can have a loss of 0/0."""
    examples, cut, lost = [], 0, 0
    for record in records:
        ids, labels = encode_record(tokenizer, record)
        if len(ids) > seq_len:
            cut += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
        if not has_target(labels):
            lost += 1
            continue
        examples.append((ids, labels))
    return examples, cut, lost


class InstructionData:
    """The tokenized data of a run: train and held-out examples, and how they were made."""

    def __init__(self, name, tokenizer, tokenizer_desc, train, held_out, cut, lost):
        self.name = name
        self.tokenizer = tokenizer
        self.tokenizer_desc = tokenizer_desc
        self.train, self.held_out = train, held_out
        self.cut, self.lost = cut, lost
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = pad if pad is not None else 0  # any valid id: padding is masked and has no label
        self.mask_window = 0  # a sliding window the dense mask applies (set by run.load: models.dense_mask_window)
        self.dense_mask = True  # packed rows carry a [B, 1, T, T] mask (set by run.load: models.document_attention)
        self.mask_dtype = None  # bool, or the float dtype of an additive mask (set by run.load: models.mask_dtype)


def prepare_data(args, records, vocab_size):
    """Tokenize ``records`` (from load_records) for the model; None for synthetic.
    Prints what it did; refuses a tokenizer whose ids the model cannot embed."""
    if records is None:
        if args.seq_len < 2:
            raise SystemExit(f"error: --dataset synthetic with --seq-len {args.seq_len}: each position learns the "
                             f"next token, so a row needs at least 2 tokens")
        print(f"Data:          synthetic tokens, {args.batch_size} x {args.seq_len} per step (no padding)")
        return None
    tokenizer, tokenizer_desc = load_tokenizer(args)
    largest_id = len(tokenizer) - 1
    if largest_id >= vocab_size:
        raise SystemExit(f"error: the tokenizer's ids go up to {largest_id} but the model's vocabulary has only "
                         f"{vocab_size} entries")
    train_records, held_records = split_records(records)
    train, cut, lost = encode_records(tokenizer, train_records, args.seq_len)
    held_out, _, _ = encode_records(tokenizer, held_records, args.seq_len)
    if not train and cut:
        raise SystemExit(f"error: --seq-len {args.seq_len} leaves no response token in any training example; "
                         f"raise --seq-len")
    if not train:
        raise SystemExit(f"error: no training example of {dataset_name(args.dataset)} has a response token "
                         f"to learn (are the responses empty?)")
    data = InstructionData(dataset_name(args.dataset), tokenizer, tokenizer_desc, train, held_out, cut, lost)
    template = "the tokenizer's chat template" if tokenizer.chat_template else "the ### Instruction/### Response template"
    print(f"Data:          {data.name}: {len(records)} records, {len(train_records)} for training, "
          f"{len(held_records)} held out")
    print(f"Tokens:        {tokenizer_desc} tokenizer, {template}; loss on the response tokens only")
    if args.packing:
        print(f"Batches:       {args.batch_size} rows of {args.seq_len} tokens, examples packed end to end "
              f"(each attends only to itself)")
    else:
        print(f"Batches:       {args.batch_size} examples, padded to the longest of the batch (at most "
              f"{args.seq_len} tokens)")
    if cut:
        flags.note(f"{cut} of {len(train_records)} training examples are longer than --seq-len {args.seq_len} and "
                   f"are cut to it")
    if lost:
        flags.note(f"{lost} of {len(train_records)} training examples have no response token to learn "
                   f"{'(cut by --seq-len, or empty) ' if cut else '(empty responses) '}and are left out")
    return data


# ---- Batches --------------------------------------------------------------------
PACKING_WINDOW = 16  # rows still open to later examples: less padding, a bounded search


class StepBatches(torch.utils.data.Dataset):
    """Batch ``k`` of a run, built on the CPU, for any step ``k``: a pure function
    of (examples, seed, k), so a run resumed at step K gets exactly the batches
    that an uninterrupted run gets from step K on.

    Epoch e visits the examples in an order drawn from (seed, e). Its rows are the
    examples one by one (padding), or the examples concatenated into rows of
    ``seq_len`` tokens, each into the first recent row it fits in (packing). Batch k is rows
    k*B ... k*B + B - 1 of the epochs laid end to end. ``endless=False``: one
    epoch in the examples' own order (the held-out set), the last batch may be short.
    """

    def __init__(self, examples, batch_size, seq_len, packing, seed, pad_id, endless=True, rank=0, ranks=1,
                 dense_mask=True, window=0, mask_dtype=None):
        self.examples, self.batch_size, self.seq_len = examples, batch_size, seq_len
        # Packing without a dense mask: the attention kernel reads the documents from
        # the position ids (models.document_attention), and no [B, 1, T, T] is built.
        # With one, ``window`` is the model's sliding window it must carry (or 0).
        self.dense_mask, self.window, self.mask_dtype = dense_mask, window, mask_dtype
        # --fsdp: step k's global batch is rows k*N*B ... of N ranks x B rows; this
        # process (rank r of N) takes its slice, rows k*N*B + r*B ... + B - 1.
        self.rank, self.ranks = rank, ranks
        self.packing, self.seed, self.pad_id, self.endless = packing, seed, pad_id, endless
        self._epochs = {}  # epoch -> its rows (lists of example indices); lengths only, cheap

    def epoch_rows(self, epoch):
        if epoch not in self._epochs:
            order = list(range(len(self.examples)))
            if self.endless:
                random.Random(f"data seed {self.seed}, epoch {epoch}").shuffle(order)
            rows, used = [], []  # used[r]: tokens in rows[r] so far
            for i in order:
                length = len(self.examples[i][0])
                # Packing: into the first of the last PACKING_WINDOW rows that has
                # room for it (a short example fills the gap a long one left);
                # else, and always when padding, it opens a row of its own.
                first = max(0, len(rows) - PACKING_WINDOW)
                fits = [r for r in range(first, len(rows)) if used[r] + length <= self.seq_len]
                if self.packing and fits:
                    rows[fits[0]].append(i)
                    used[fits[0]] += length
                else:
                    rows.append([i])
                    used.append(length)
            self._epochs[epoch] = rows
        return self._epochs[epoch]

    def num_batches(self):
        """Batches in one epoch (the held-out set's batch count)."""
        return -(-len(self.epoch_rows(0)) // self.batch_size)

    def rows(self, start, count):
        """Rows start ... start + count - 1 of the epochs laid end to end."""
        out, epoch, epoch_start = [], 0, 0
        while len(out) < count:
            rows = self.epoch_rows(epoch)
            i = start + len(out) - epoch_start
            if i < len(rows):
                out.extend(rows[i: i + count - len(out)])
            elif not self.endless:
                break
            else:
                epoch, epoch_start = epoch + 1, epoch_start + len(rows)
        return out

    def __getitem__(self, step):
        first = (step * self.ranks + self.rank) * self.batch_size
        return self.collate(self.rows(first, self.batch_size))

    def collate(self, rows):
        """The batch dict (see the top of this section) of ``rows`` of example indices."""
        lengths = [[len(self.examples[i][0]) for i in row] for row in rows]
        width = self.seq_len if self.packing else max(sum(row) for row in lengths)
        shape = (len(rows), width)
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        document = torch.zeros(shape, dtype=torch.long)  # packing: which example each slot holds
        for b, row in enumerate(rows):
            t = 0
            for d, i in enumerate(row):
                ids, labs = self.examples[i]
                n = len(ids)
                input_ids[b, t: t + n] = torch.tensor(ids)
                labels[b, t: t + n] = torch.tensor(labs)
                # The first token of an example is never a target: after the shift
                # it would be predicted from the previous example's last token.
                labels[b, t] = IGNORE_INDEX
                position_ids[b, t: t + n] = torch.arange(n)  # RoPE sees each example from position 0
                document[b, t: t + n] = d
                t += n
            # The padding after the last example is a document of its own: no real
            # token attends to it, and each padding query still sees itself (a query
            # that may attend to nothing gives NaN in SDPA).
            position_ids[b, t:] = torch.arange(width - t)
            document[b, t:] = len(row)
        real = sum(sum(row) for row in lengths)
        if self.packing:
            attention_mask = block_causal_mask(document, self.window, self.mask_dtype) if self.dense_mask else None
        else:
            # Padding: one example per row, padded on the right, so the model's own
            # positions 0, 1, 2, ... are right and a [B, T] mask hides the padding.
            attention_mask = (document == 0).long()
            position_ids = None
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                "attention_mask": attention_mask, "num_tokens": input_ids.numel(), "num_real_tokens": real}


def block_causal_mask(document, window=0, dtype=None):
    """[B, T] example index of every slot -> [B, 1, T, T] bool, True where query t may
    attend to key s: same example, s <= t, and with a sliding ``window`` > 0, s > t -
    window (the model's own window: models.dense_mask_window). With a float ``dtype``
    the same as HF's additive form, 0 where allowed and the dtype's lowest value
    elsewhere: HF's eager attention adds a ready mask to the scores as it is, and a
    bool one would add 1 and 0 and hide nothing (models.mask_dtype).

    Passed to the model as a ready 4-D mask, HF's SDPA attention uses it as given:
    attention never crosses examples, exactly. It costs B * T * T bytes
    (8 MB at 2 x 2048), and SDPA with an explicit mask uses the memory-efficient
    kernel, not flash attention.
    """
    seq_len = document.shape[1]
    same = document[:, :, None] == document[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if window:
        causal = causal.triu(-(window - 1))  # s >= t - window + 1
    allowed = (same & causal)[:, None]
    return allowed if dtype is None else additive_mask(allowed, dtype)


def check_dense_mask(model, data):
    """Packed rows with a dense mask need a model whose forward takes a ready [B, 1, T, T]
    one; some build their own from a [B, T] mask (Bloom's ALiBi) and fail deep inside.
    One row of two examples of 8 tokens (16: a multiple some FP8 casts require), in eval mode without
    gradients, says so in one line."""
    device = next(p.device for p in model.parameters())
    ids = torch.zeros(1, 16, dtype=torch.long, device=device)  # token 0: in every vocabulary
    document = torch.arange(16)[None] // 8
    mask = block_causal_mask(document, data.mask_window, data.mask_dtype).to(device)
    try:
        with torch.no_grad(), evaluating(model):
            model(input_ids=ids, attention_mask=mask, position_ids=(torch.arange(16) % 8)[None].to(device))
    except Exception as e:  # noqa: BLE001 - the model's own code: said in one line
        raise SystemExit(f"error: --packing: {type(model).__name__} does not take the packed rows' [B, 1, T, T] "
                         f"mask ({error_line(e)}); use --no-packing") from None


def loader(dataset, steps, args):
    """A DataLoader over batch indices ``steps``: --num-workers processes build the
    batches ahead of the training step, in pinned host memory when there is a GPU
    (--pin-memory, the default). From pinned memory the GPU's copy engine reads the
    batch directly and cudaMemcpyAsync returns at once; from pageable memory the
    driver first copies it into a pinned staging buffer, and the CPU waits for that
    instead of queueing the next kernels (profile_baseline.py counts both kinds)."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,  # each index is a whole batch already
        sampler=steps,
        num_workers=args.num_workers,
        pin_memory=torch.cuda.is_available() and getattr(args, "pin_memory", True),
    )


def training_batches(args, data, device, vocab_size, start_step=0):
    """The endless stream of training steps on ``device``, from step ``start_step``
    on (0-based): each is a list of --grad-accum batch dicts (its micro-batches).

    Micro-batch k of the run (k = step * grad_accum + m) is the same whether the
    stream started at 0 or later: synthetic data replays its seeded generator,
    real data builds batch k from (seed, k) alone (StepBatches). So a resumed run
    gets exactly the batches the uninterrupted run had.
    """
    accum = getattr(args, "grad_accum", 1)  # the profile script has no --grad-accum
    first = start_step * accum
    # --fsdp: each of the N processes takes its B rows of the global batch of N x B
    # rows, the batch one process with --batch-size N x B would train on.
    rank, ranks = fsdp.rank_and_size()
    if data is None:  # synthetic: the seeded generator, replayed up to the first micro-batch
        b = args.batch_size
        stream = (lm_batch(ids[rank * b: (rank + 1) * b]) for ids, _ in
                  synthetic_batches(b * ranks, args.seq_len, vocab_size, args.seed, device))
        stream = itertools.islice(stream, first, None)
    else:
        dataset = StepBatches(data.train, args.batch_size, args.seq_len, args.packing, args.seed, data.pad_id,
                              rank=rank, ranks=ranks, dense_mask=data.dense_mask,
                              window=data.mask_window, mask_dtype=data.mask_dtype)
        stream = (batch_to(batch, device) for batch in loader(dataset, itertools.count(first), args))
    while True:
        yield [next(stream) for _ in range(accum)]


def held_out_batches(args, data, device, vocab_size):
    """The held-out batches an evaluation averages over, a list (at most
    --eval-batches of them; ``args.eval_batches`` None: all). Real data: the held-out
    examples, in a fixed order, batched like the training data (none if the set
    is too small to hold any out). Synthetic: the same generator with another
    seed, so no training step sees them."""
    limit = getattr(args, "eval_batches", None)
    if data is None:
        stream = synthetic_batches(args.batch_size, args.seq_len, vocab_size, args.seed + EVAL_SEED_OFFSET, device)
        return [lm_batch(ids) for ids, _ in itertools.islice(stream, limit or flags.EVAL_BATCHES)]
    if not data.held_out:
        return []
    dataset = StepBatches(data.held_out, args.batch_size, args.seq_len, args.packing, args.seed, data.pad_id,
                          endless=False, dense_mask=data.dense_mask,
                          window=data.mask_window, mask_dtype=data.mask_dtype)
    count = dataset.num_batches() if limit is None else min(limit, dataset.num_batches())
    return [batch_to(batch, device) for batch in loader(dataset, range(count), args)]
