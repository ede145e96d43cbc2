//! The tokenizer: a byte-level BPE in Hugging Face's `tokenizer.json` format, built by the
//! checkpoint generator from a small embedded text, and the DeepSeek-V3 chat template.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{anyhow, Result};

/// Beginning-of-sequence token (DeepSeek-V3 spelling).
pub const BOS: &str = "<｜begin▁of▁sentence｜>";
/// End-of-sequence token.
pub const EOS: &str = "<｜end▁of▁sentence｜>";
/// Marks a user turn in the chat template.
pub const USER: &str = "<｜User｜>";
/// Marks an assistant turn in the chat template.
pub const ASSISTANT: &str = "<｜Assistant｜>";

/// Text the generator learns BPE merges from (any English prose gives sensible merges).
const CORPUS: &str = "The quick brown fox jumps over the lazy dog. Experts in a mixture of \
experts model are small feed forward networks; the router sends each token to the experts \
that fit it best, and the outputs are weighted and added. Expert parallelism places the \
experts of one layer on many devices, so tokens travel to the experts and then come back. \
In the beginning there was the word, and the word was the token, and the token was the \
thing that the model read. Then the model wrote another token, and then another one, until \
the end of the sentence. These are the things that the server does when there is a request.";

/// Maps each byte to the printable character that stands for it in byte-level BPE
/// (printable Latin-1 bytes stand for themselves, the others are moved above U+0100).
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        *slot = if printable {
            char::from_u32(b as u32).expect("Latin-1 is valid")
        } else {
            let c = char::from_u32(256 + next).expect("below the surrogates");
            next += 1;
            c
        };
    }
    table
}

/// Splits text roughly the way the byte-level pre-tokenizer does (words keep their leading
/// space) and maps each piece to byte-level characters.
fn pre_tokenize(text: &str, table: &[char; 256]) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut current = String::new();
    let mut prev_alnum = None;
    for ch in text.chars() {
        let alnum = ch.is_alphanumeric();
        let starts_new =
            ch == ' ' || prev_alnum.is_some_and(|p| p != alnum && !current.ends_with(' '));
        if starts_new && !current.is_empty() {
            pieces.push(std::mem::take(&mut current));
        }
        current.push(ch);
        prev_alnum = Some(alnum);
    }
    if !current.is_empty() {
        pieces.push(current);
    }
    pieces
        .into_iter()
        .map(|p| p.bytes().map(|b| table[b as usize]).collect())
        .collect()
}

/// Learns up to `num_merges` BPE merges from `corpus` (most frequent pair first, ties broken
/// by the pair's spelling, so the result is deterministic).
fn learn_merges(corpus: &str, num_merges: usize) -> Vec<(String, String)> {
    let table = byte_to_char();
    let mut words: BTreeMap<String, usize> = BTreeMap::new();
    for w in pre_tokenize(corpus, &table) {
        *words.entry(w).or_default() += 1;
    }
    let mut split: Vec<(Vec<String>, usize)> = words
        .into_iter()
        .map(|(w, n)| (w.chars().map(String::from).collect(), n))
        .collect();
    let mut merges = Vec::new();
    while merges.len() < num_merges {
        let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
        for (symbols, n) in &split {
            for pair in symbols.windows(2) {
                *counts
                    .entry((pair[0].clone(), pair[1].clone()))
                    .or_default() += n;
            }
        }
        // Highest count; among equal counts the first pair in spelling order.
        let Some((best, count)) = counts.into_iter().fold(
            None,
            |acc: Option<((String, String), usize)>, (p, c)| match acc {
                Some((_, bc)) if bc >= c => acc,
                _ => Some((p, c)),
            },
        ) else {
            break;
        };
        if count < 2 {
            break;
        }
        let joined = format!("{}{}", best.0, best.1);
        for (symbols, _) in &mut split {
            let mut out = Vec::with_capacity(symbols.len());
            let mut i = 0;
            while i < symbols.len() {
                if i + 1 < symbols.len() && symbols[i] == best.0 && symbols[i + 1] == best.1 {
                    out.push(joined.clone());
                    i += 2;
                } else {
                    out.push(symbols[i].clone());
                    i += 1;
                }
            }
            *symbols = out;
        }
        merges.push(best);
    }
    merges
}

/// Builds the `tokenizer.json` text of a byte-level BPE with at most `vocab_size` tokens:
/// the four special tokens (ids 0..4), the 256 byte tokens, then learned merges.
pub fn build_tokenizer_json(vocab_size: usize) -> Result<String> {
    let specials = [BOS, EOS, USER, ASSISTANT];
    let base = specials.len() + 256;
    if vocab_size < base {
        anyhow::bail!(
            "vocab_size {vocab_size} is too small for a byte-level tokenizer (needs >= {base})"
        );
    }
    let mut vocab: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    vocab.extend(byte_to_char().iter().map(|c| c.to_string()));
    let merges = learn_merges(CORPUS, vocab_size - base);
    for (a, b) in &merges {
        vocab.push(format!("{a}{b}"));
    }
    let vocab_map: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({
                "id": i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            })
        })
        .collect();
    let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab_map, "merges": merges
        }
    });
    Ok(serde_json::to_string_pretty(&json)?)
}

/// For each id below `vocab_size` of the tokenizer [`build_tokenizer_json`] makes, whether it
/// reads as plain text: end-of-sentence, printable ASCII bytes, newline, and learned merges
/// (which are made of those). The generator uses it so random models write readable bytes.
pub fn plain_text_tokens(vocab_size: usize) -> Vec<bool> {
    let specials = 4;
    let base = specials + 256;
    let merges = learn_merges(CORPUS, vocab_size.saturating_sub(base)).len();
    (0..vocab_size)
        .map(|id| {
            if id < specials {
                id == 1 // EOS
            } else if id < base {
                let byte = id - specials;
                (32..=126).contains(&byte) || byte == b'\n' as usize
            } else {
                id < base + merges
            }
        })
        .collect()
}

/// One chat message (`role` is `system`, `user` or `assistant`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said.
    pub content: String,
}

/// A loaded `tokenizer.json` with the ids of the special tokens the server needs.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    special: HashMap<String, u32>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("{}: cannot load tokenizer: {e}", path.display()))?;
        Ok(Self::from_inner(inner))
    }

    /// A tokenizer from the text of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e| anyhow!("cannot load tokenizer: {e}"))?;
        Ok(Self::from_inner(inner))
    }

    fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        let special: HashMap<String, u32> = [BOS, EOS, USER, ASSISTANT]
            .iter()
            .filter_map(|s| inner.token_to_id(s).map(|id| (s.to_string(), id)))
            .collect();
        Self {
            bos: special.get(BOS).copied(),
            eos: special.get(EOS).copied(),
            inner,
            special,
        }
    }

    /// Beginning-of-sequence id, when the vocabulary has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence id, when the vocabulary has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The id of `token` (special tokens included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.special
            .get(token)
            .copied()
            .or_else(|| self.inner.token_to_id(token))
    }

    /// Encodes `text` (special tokens written in the text are recognised, none are added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenize: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// A completion prompt: BOS then the text.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// DeepSeek-V3's chat template: BOS, system messages, then `<｜User｜>` / `<｜Assistant｜>`
    /// turns (assistant turns closed by EOS), ending with `<｜Assistant｜>` for the reply.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let mut text = String::new();
        for m in messages.iter().filter(|m| m.role == "system") {
            text.push_str(&m.content);
        }
        for m in messages {
            match m.role.as_str() {
                "system" => {}
                "user" => {
                    text.push_str(USER);
                    text.push_str(&m.content);
                }
                "assistant" => {
                    text.push_str(ASSISTANT);
                    text.push_str(&m.content);
                    text.push_str(EOS);
                }
                other => anyhow::bail!(
                    "message role {other:?} is not supported (use system, user or assistant)"
                ),
            }
        }
        text.push_str(ASSISTANT);
        self.encode_prompt(&text)
    }

    /// Decodes ids to text, dropping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("cannot decode tokens: {e}"))
    }

    /// Vocabulary size including special tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
