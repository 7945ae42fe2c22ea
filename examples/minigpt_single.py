"""jax-ai-stack's miniGPT tutorial as a script, on this process's devices: the baseline of minigpt.py.

Source: "Train a miniGPT language model with JAX",
https://github.com/jax-ml/jax-ai-stack/blob/59de2e1f79348ac85ee26c463c3cede21d8908a5/docs/source/JAX_for_LLM_pretraining.md
(commit 59de2e1f, 2026-05-11): its model, data pipeline, training loop and
checkpoint cells in their order, the code kept as written except where noted.
`minigpt.py` is this file made data-parallel over processes with jdist;
`diff` the two to see the changes.

Deviations from upstream (nothing to download, and seconds on a CPU):
* Data: TinyStories (a download) becomes `--data`, or by default
  `tiny_stories()` below: short stories generated deterministically from
  templates, in TinyStories' format (stories separated by <|endoftext|>).
* Tokenizer: tiktoken's GPT-2 encoding needs its BPE file from the internet,
  so `ByteTokenizer` (UTF-8 bytes plus <|endoftext|> as token 256) stands in
  with the same `encode`/`decode`/`n_vocab` (264: 257 used, padded so the
  output layer's columns divide by the 'model' axis).
* flax 0.12 (upstream pins 0.12.7) shards variables when they are created,
  where the tutorial's annotations were metadata: its three 1-D parameters
  annotated P(None, 'model') (layer_norm2's scale and bias, the output
  bias) are annotated P('model'), and the list of blocks is an `nnx.List`
  (a plain list of modules is an error there). Upstream fails at both.
* pandas (only `DataFrame(...)['text'].dropna().tolist()`) is not installed:
  the stories list is used directly.
* Sizes come from the command line with small defaults (2 blocks, embed 64,
  4 heads, seq 64, global batch 8, 20 steps; upstream: 8 (used: 4) blocks, 256,
  8, 256, 144 per 2 devices, one epoch of TinyStories); `create_model` uses
  `num_transformer_blocks` (upstream hard-codes 4 and ignores the setting).
* The mesh is (devices / --model-parallel, --model-parallel) over
  `jax.devices()` instead of upstream's fixed (4, 2) for 8 devices and (1, 1)
  for one.
* The loop stops after `--max-steps` and logs every `--log-every` steps
  (upstream: 200), generating `--generate-tokens` tokens (upstream: maxlen).
* The checkpoint goes to `--checkpoint-dir` (upstream: /content/save), and
  the notebook's `!ls`, plotting and profiling cells are left out.

    .venv/bin/python examples/minigpt_single.py --max-steps 20
"""

import argparse
import os
import random
import tempfile

import jax
import jax.numpy as jnp

from jax.sharding import Mesh, PartitionSpec as P, NamedSharding # For data and model parallelism (explained in more detail later)
from jax.experimental import mesh_utils

import flax.nnx as nnx
import optax

from dataclasses import dataclass
import grain.python as pygrain
import time


def tiny_stories(count: int, seed: int = 0) -> str:
  """`count` short stories in TinyStories' format, the same for a seed."""
  rng = random.Random(seed)
  names = ["Lily", "Tom", "Mia", "Ben", "Sue", "Max", "Anna", "Sam"]
  things = ["ball", "kite", "cat", "dog", "boat", "cake", "tree", "star"]
  feelings = ["happy", "sad", "brave", "sleepy", "kind", "curious"]
  stories = []
  for _ in range(count):
    name, friend = rng.sample(names, 2)
    thing, feeling = rng.choice(things), rng.choice(feelings)
    stories.append(f"Once upon a time, there was a {feeling} child named {name}. "
                   f"{name} had a red {thing}. One day, {friend} wanted to play with the {thing}. "
                   f"{name} said yes, and they were {rng.choice(feelings)} together. The end.")
  return "<|endoftext|>".join(stories) + "<|endoftext|>"


class ByteTokenizer:
  """tiktoken's interface over UTF-8 bytes; <|endoftext|> is token 256."""
  n_vocab = 264  # 257 used, padded to a multiple of 8 so the output layer shards over 'model'
  eot = "<|endoftext|>"

  def encode(self, text, allowed_special=()):
    pieces = text.split(self.eot) if self.eot in allowed_special else [text]
    tokens = list(pieces[0].encode())
    for piece in pieces[1:]:
      tokens += [256] + list(piece.encode())
    return tokens

  def decode(self, tokens):
    return b"".join(self.eot.encode() if t == 256 else bytes([t]) for t in tokens).decode(errors="replace")


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", help="a text file of stories separated by <|endoftext|> (default: generated)")
parser.add_argument("--stories", type=int, default=1000, help="how many stories to generate")
parser.add_argument("--model-parallel", type=int, default=1, help="the mesh's 'model' axis")
parser.add_argument("--num-transformer-blocks", type=int, default=2)
parser.add_argument("--maxlen", type=int, default=64)
parser.add_argument("--embed-dim", type=int, default=64)
parser.add_argument("--num-heads", type=int, default=4)
parser.add_argument("--feed-forward-dim", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=8, help="the global batch")
parser.add_argument("--max-steps", type=int, default=20)
parser.add_argument("--log-every", type=int, default=5)
parser.add_argument("--generate-tokens", type=int, default=20)
parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "minigpt_save"))
args = parser.parse_args()
if args.data is None:
  args.data = os.path.join(tempfile.mkdtemp(), "TinyStories-train.txt")
  with open(args.data, "w") as f:
    f.write(tiny_stories(args.stories))

# Create a `Mesh` object representing TPU device arrangement.
mesh = Mesh(mesh_utils.create_device_mesh((jax.device_count() // args.model_parallel, args.model_parallel)), ('batch', 'model'))

tokenizer = ByteTokenizer()

# Define a triangular mask for causal attention with `jax.numpy.tril` and `jax.numpy.ones`.
def causal_attention_mask(seq_len):
    return jnp.tril(jnp.ones((seq_len, seq_len)))

class TransformerBlock(nnx.Module):
    """ A single Transformer block.

    Each Transformer block processes input sequences via self-attention and feed-forward networks.

    Args:
        embed_dim (int): Embedding dimensionality.
        num_heads (int): Number of attention heads.
        ff_dim (int): Dimensionality of the feed-forward network.
        rngs (flax.nnx.Rngs): A Flax NNX stream of JAX PRNG keys.
        rate (float): Dropout rate. Defaults to 0.1.
    """
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
        # Multi-Head Attention (MHA) with `flax.nnx.MultiHeadAttention`.
        # Specifies tensor sharding (depending on the mesh configuration)
        # where we shard the weights across devices for parallel computation.
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads,
                                          in_features=embed_dim,
                                          kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), NamedSharding(mesh, P(None, 'model'))),
                                          bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                          rngs=rngs)
        # The first dropout with `flax.nnx.Dropout`.
        self.dropout1 = nnx.Dropout(rate=rate)
        # First layer normalization with `flax.nnx.LayerNorm`.
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6,
                                         num_features=embed_dim,
                                         scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), NamedSharding(mesh, P('model'))),
                                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                         rngs=rngs)
        # The first linear transformation for the feed-forward network with `flax.nnx.Linear`.
        self.linear1 = nnx.Linear(in_features=embed_dim,
                                  out_features=ff_dim,
                                  kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), NamedSharding(mesh, P(None, 'model'))),
                                  bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                  rngs=rngs)
        # The second linear transformation for the feed-forward network with `flax.nnx.Linear`.
        self.linear2 = nnx.Linear(in_features=ff_dim,
                                  out_features=embed_dim,
                                  kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), NamedSharding(mesh, P(None, 'model'))),
                                  bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                  rngs=rngs)
        # The second dropout with `flax.nnx.Dropout`.
        self.dropout2 = nnx.Dropout(rate=rate)
        # Second layer normalization with `flax.nnx.LayerNorm`.
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6,
                                         num_features=embed_dim,
                                         scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), NamedSharding(mesh, P('model'))),
                                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                         rngs=rngs)


    # Apply the Transformer block to the input sequence.
    def __call__(self, inputs, training: bool = False):
        input_shape = inputs.shape
        _, seq_len, _ = input_shape

        # Instantiate the causal attention mask.
        mask = causal_attention_mask(seq_len)

        # Apply Multi-Head Attention with the causal attention mask.
        attention_output = self.mha(
            inputs_q=inputs,
            mask=mask,
            decode=False
        )
        # Apply the first dropout.
        attention_output = self.dropout1(attention_output, deterministic=not training)
        # Apply the first layer normalization.
        out1 = self.layer_norm1(inputs + attention_output)

        # The feed-forward network.
        # Apply the first linear transformation.
        ffn_output = self.linear1(out1)
        # Apply the ReLU activation with `flax.nnx.relu`.
        ffn_output = nnx.relu(ffn_output)
        # Apply the second linear transformation.
        ffn_output = self.linear2(ffn_output)
        # Apply the second dropout.
        ffn_output = self.dropout2(ffn_output, deterministic=not training)
        # Apply the second layer normalization and return the output of the Transformer block.
        return self.layer_norm2(out1 + ffn_output)

class TokenAndPositionEmbedding(nnx.Module):
    """ Combines token embeddings (words in an input sentence) with
    positional embeddings (the position of each word in a sentence).

    Args:
        maxlen (int): Matimum sequence length.
        vocal_size (int): Vocabulary size.
        embed_dim (int): Embedding dimensionality.
        rngs (flax.nnx.Rngs): A Flax NNX stream of JAX PRNG keys.
    """
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        # Initialize token embeddings (using `flax.nnx.Embed`).
        # Each unique word has an embedding vector.
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        # Initialize positional embeddings (using `flax.nnx.Embed`).
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    # Takes a token sequence (integers) and returns the combined token and positional embeddings.
    def __call__(self, x):
        # Generate a sequence of positions for the input tokens.
        positions = jnp.arange(0, x.shape[1])[None, :]
        # Look up the positional embeddings for each position in the input sequence.
        position_embedding = self.pos_emb(positions)
        # Look up the token embeddings for each token in the input sequence.
        token_embedding = self.token_emb(x)
        # Combine token and positional embeddings.
        return token_embedding + position_embedding

class MiniGPT(nnx.Module):
    """ A miniGPT transformer model, inherits from `flax.nnx.Module`.

    Args:
        maxlen (int): Maximum sequence length.
        vocab_size (int): Vocabulary size.
        embed_dim (int): Embedding dimensionality.
        num_heads (int): Number of attention heads.
        feed_forward_dim (int): Dimensionality of the feed-forward network.
        num_transformer_blocks (int): Number of transformer blocks. Each block contains attention and feed-forward networks.
        rngs (nnx.Rngs): A Flax NNX stream of JAX PRNG keys.
    """
    # Initialize miniGPT model components.
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int, feed_forward_dim: int, num_transformer_blocks: int, rngs: nnx.Rngs):
        # Initiliaze the `TokenAndPositionEmbedding` that combines token and positional embeddings.
        self.embedding_layer = TokenAndPositionEmbedding(
                    maxlen, vocab_size, embed_dim, rngs=rngs
                )
        # Create a list of `TransformerBlock` instances.
        # Each block processes input sequences using attention and feed-forward networks.
        self.transformer_blocks = nnx.List([TransformerBlock(
            embed_dim, num_heads, feed_forward_dim, rngs=rngs
        ) for _ in range(num_transformer_blocks)])
        # Initialize the output `flax.nnx.Linear` layer producing logits over the vocabulary for next-token prediction.
        self.output_layer = nnx.Linear(in_features=embed_dim,
                                       out_features=vocab_size,
                                       kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), NamedSharding(mesh, P(None, 'model'))),
                                       bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                       rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        # Pass the input tokens through the `embedding_layer` to get token embeddings.
        # Apply each transformer block sequentially to the embedded input, use the `training` flag for the behavior of `flax.nnx.Dropout`.
        x = self.embedding_layer(inputs)
        for transformer_block in self.transformer_blocks:
            x = transformer_block(x, training=training)
        # Pass the output of the transformer blocks through the output layer,
        # and obtain logits for each token in the vocabulary (for next token prediction).
        outputs = self.output_layer(x)
        return outputs

    @nnx.jit
    def sample_from(self, logits):
        logits, indices = jax.lax.top_k(logits, k=top_k)
        logits = nnx.softmax(logits)
        return jax.random.choice(jax.random.PRNGKey(0), indices, p=logits)

    @nnx.jit
    def generate_step(self, padded_tokens, sample_index):
        logits = self(padded_tokens)
        next_token = self.sample_from(logits[0][sample_index])
        return next_token

    def generate_text(self, max_tokens, start_tokens):
        generated = []
        print(tokenizer.decode(start_tokens), flush=True, end='')
        for i in range(max_tokens):
            sample_index = len(start_tokens) + len(generated) - 1

            padded_tokens = jnp.array((start_tokens + generated + [0] * (maxlen - len(start_tokens) - len(generated))))[None, :]
            next_token = int(self.generate_step(padded_tokens, sample_index))
            if next_token == tokenizer.encode('<|endoftext|>', allowed_special={'<|endoftext|>'})[0]:
              break
            generated.append(next_token)
            # decode and print next_token
            print(tokenizer.decode([next_token]), flush=True, end='')
        return tokenizer.decode(start_tokens + generated)

# Creates the miniGPT model with `num_transformer_blocks` transformer blocks.
def create_model(rngs):
    return MiniGPT(maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim, num_transformer_blocks=num_transformer_blocks, rngs=rngs)

vocab_size = tokenizer.n_vocab
num_transformer_blocks = args.num_transformer_blocks
maxlen = args.maxlen
embed_dim = args.embed_dim
num_heads = args.num_heads
feed_forward_dim = args.feed_forward_dim
batch_size = args.batch_size
num_epochs = 1
top_k = 10

@dataclass
class TextDataset:
    data: list
    maxlen: int

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx: int):
        # Use Tiktoken for tokenization
        encoding = tokenizer.encode(self.data[idx], allowed_special={'<|endoftext|>'})[:self.maxlen]  # Tokenize and truncate
        return encoding + [0] * (self.maxlen - len(encoding))  # Pad to maxlen

def load_and_preprocess_data(file_path, batch_size, maxlen):

    with open(file_path, 'r') as f:
      text = f.read()

    stories = text.split('<|endoftext|>')
    stories = [story+'<|endoftext|>' for story in stories if story.strip()]
    data = stories
    dataset = TextDataset(data, maxlen)

    sampler = pygrain.IndexSampler(
        len(dataset),
        shuffle=False,
        seed=42,
        shard_options=pygrain.NoSharding(),
        num_epochs=num_epochs,
    )

    dl = pygrain.DataLoader(
        data_source=dataset,
        sampler=sampler,
        operations=[pygrain.Batch(batch_size=batch_size, drop_remainder=True)],
    )

    return dl

text_dl = load_and_preprocess_data(args.data, batch_size, maxlen)

# Defines the loss function using `optax.softmax_cross_entropy_with_integer_labels`.
def loss_fn(model, batch):
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits

# Define the training step with the `flax.nnx.jit` transformation decorator.
@nnx.jit
def train_step(model: MiniGPT, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, lables=batch[1])
    optimizer.update(model, grads)

model = create_model(rngs=nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
metrics = nnx.MultiMetric(
    loss=nnx.metrics.Average("loss"),
)
rng = jax.random.PRNGKey(0)

start_prompt = "Once upon a time"
start_tokens = tokenizer.encode(start_prompt)[:maxlen]
print("Initial generated text:")
generated_text = model.generate_text(args.generate_tokens, start_tokens)

metrics_history = {
    "train_loss": [],
}

prep_target_batch = jax.vmap(
    lambda tokens: jnp.concatenate((tokens[1:], jnp.array([0])))
)

step = 0
for epoch in range(num_epochs):
    start_time = time.time()
    for batch in text_dl:
        if len(batch) % len(jax.devices()) != 0:
            continue  # skip the remaining elements
        input_batch = jnp.array(jnp.array(batch).T)
        target_batch = prep_target_batch(input_batch)
        train_step(
            model,
            optimizer,
            metrics,
            jax.device_put(
                (input_batch, target_batch), NamedSharding(mesh, P("batch", None))
            ),
        )

        if (step + 1) % args.log_every == 0:
            for metric, value in metrics.compute().items():
                metrics_history[f"train_{metric}"].append(value)
            metrics.reset()

            elapsed_time = time.time() - start_time
            print(
                f"\n\nStep {step + 1}, Loss: {metrics_history['train_loss'][-1]}, Elapsed Time: {elapsed_time:.2f} seconds"
            )
            start_time = time.time()

            print("Generated text:")
            generated_text = model.generate_text(args.generate_tokens, start_tokens)

        step += 1
        if step == args.max_steps:
            break

# Final text generation
print("Final generated text:")
generated_text = model.generate_text(args.generate_tokens, start_tokens)

import orbax.checkpoint as orbax

state = nnx.state(model)

checkpointer = orbax.PyTreeCheckpointer()
checkpointer.save(args.checkpoint_dir, args=orbax.args.PyTreeSave(state), force=True)
