// Deterministic text corpora for the tokenizer oracle and benchmark. Everything comes from a
// seeded PRNG, so a given seed yields the same strings on every machine and node version.

// mulberry32: a small, fast 32-bit PRNG; returns floats in [0, 1).
export function makeRng(seed) {
  let state = seed >>> 0;
  const next = () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const int = (lo, hi) => lo + Math.floor(next() * (hi - lo + 1)); // inclusive
  const pick = (items) => items[Math.floor(next() * items.length)];
  const chance = (p) => next() < p;
  const fromRange = (lo, hi) => String.fromCodePoint(int(lo, hi));
  const repeat = (n, make) => Array.from({ length: n }, make).join('');
  return { next, int, pick, chance, fromRange, repeat };
}

const WORDS = (
  'the of and to in is was he for it with as his on be at by had are but from or have an they which one you ' +
  'were her all she there would their we him been has when who will more no if out so said what up its about ' +
  'into than them can only other new some could time these two may then do first any my now such like our over ' +
  'man me even most made after also did many before must through back years where much your way well down should ' +
  'because each just those people how too little state good very make world still own see men work long get here ' +
  'between both life being under never day same another know while last might us great old year off come since ' +
  'against go came right used take three tokenizer encoding language model server request'
).split(' ');

const CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'D", "'rE"];
const PUNCTUATION = ['.', ',', '!', '?', ';', ':', '...', ' -', ' —', ' (', ')', '"', "'", '?!', ' ¿', ' «', '»'];

// Every kind of whitespace the pre-tokenizer regexes treat specially.
const SPACES = [
  ' ', '  ', '\t', '\n', '\r\n', '\r', '\n\n', '\u000b', '\u000c', '\u0085', '\u00a0', '\u1680', '\u180e',
  '\u2000', '\u2001', '\u2002', '\u2003', '\u2004', '\u2005', '\u2006', '\u2007', '\u2008', '\u2009', '\u200a',
  '\u200b', '\u2028', '\u2029', '\u202f', '\u205f', '\u3000', '\ufeff',
];

const EMOJI = [
  '😀', '😂', '🥲', '👍', '👍🏽', '👩🏿‍💻', '👨‍👩‍👧‍👦', '🏳️‍🌈', '🏴‍☠️', '❤️', '❤️‍🔥', '🇺🇸', '🇯🇵', '🇩🇪', '🇧🇷',
  '1️⃣', '#️⃣', '©️', '☺︎', '🧑‍🤝‍🧑', '🫠', '🦀', '🐍', '🚀', '✨', '🤷‍♀️', '🙋🏻‍♂️', '🏴󠁧󠁢󠁳󠁣󠁴󠁿',
];

const CODE_TEMPLATES = [
  (r, id, n) => `def ${id}(x, y=${n}):\n    return x * y + ${r.int(0, 99)}\n`,
  (r, id, n) => `for (int ${id} = 0; ${id} < ${n}; ++${id}) {\n\tsum += values[${id}];\n}\n`,
  (r, id, n) => `const ${id} = await fetch("https://example.com/api/v${r.int(1, 3)}?n=${n}");\r\n`,
  (r, id, n) => `{"${id}": [${n}, ${r.int(0, 9)}.${r.int(0, 99)}, null, true], "name": "x_${id}"}`,
  (r, id, n) => `#include <vector>\nstd::vector<int> ${id}(${n}, -1);  // ${id.toUpperCase()}\n`,
  (r, id, n) => `SELECT ${id}, COUNT(*) FROM t WHERE v >= ${n} GROUP BY ${id};`,
  (r, id, n) => `    if ${id} != nil {\n        return fmt.Errorf("bad %d", ${n})\n    }\n`,
  (r, id, n) => `$ ls -la /usr/lib | grep ${id} && echo $((${n}+1)) 2>&1 >/dev/null`,
  (r, id, n) => `<div class="${id}">${n}&nbsp;&lt;b&gt;</div>\n`,
  (r, id, n) => `fn ${id}<'a>(s: &'a str) -> Option<&'a str> { s.get(..${n}) }`,
  (r, id, n) => `\\begin{equation} ${id}_{${n}} = \\sum_{i=1}^{n} x_i^2 \\end{equation}`,
  (r, id, n) => `${id} = lambda: [i**2 for i in range(${n}) if i % 3 == 0]  # it's fine`,
];

function identifier(r) {
  const parts = r.repeat(r.int(1, 3), () => r.pick(WORDS) + '_').slice(0, -1);
  return r.chance(0.3) ? parts.replace(/_(.)/g, (_, c) => c.toUpperCase()) : parts;
}

function latinSentence(r) {
  let out = '';
  for (let i = 0, n = r.int(1, 14); i < n; i++) {
    let word = r.pick(WORDS);
    const casing = r.next();
    if (casing < 0.15) word = word.toUpperCase();
    else if (casing < 0.35) word = word[0].toUpperCase() + word.slice(1);
    if (r.chance(0.15)) word += r.pick(CONTRACTIONS);
    if (r.chance(0.05)) word = r.pick(CONTRACTIONS) + word;
    out += (i > 0 ? (r.chance(0.9) ? ' ' : r.pick(SPACES)) : '') + word;
    if (r.chance(0.15)) out += r.pick(PUNCTUATION);
  }
  return out;
}

function latinAccented(r) {
  const words = ['café', 'naïve', 'façade', 'Größe', 'déjà vu', 'smörgåsbord', 'Ångström', 'señor', 'Łódź', 'İstanbul',
    'ß', 'œuvre', 'Ærø', 'ǅemal', 'ﬁnance', 'Ⅻ', 'x²', 'µ', 'ǈ', 'ẞ', 'Ｆｕｌｌｗｉｄｔｈ'];
  return r.repeat(r.int(1, 6), () => r.pick(words) + r.pick([' ', ' ', ', ', '. ']));
}

function cjk(r) {
  const pieces = [
    () => r.repeat(r.int(1, 12), () => r.fromRange(0x4e00, 0x9fa5)),
    () => r.repeat(r.int(1, 8), () => r.fromRange(0x3041, 0x3096)),
    () => r.repeat(r.int(1, 8), () => r.fromRange(0x30a1, 0x30fa)),
    () => r.pick(['，', '。', '「', '」', '、', '！', '？', '（', '）', '：', '・', 'ー', '〜']),
    () => r.repeat(r.int(1, 3), () => r.fromRange(0x3400, 0x4dbf)),
    () => r.repeat(r.int(1, 2), () => r.fromRange(0x20000, 0x2a6df)),
    () => r.pick(['东京', '北京大学', '日本語のテキスト', 'か゛', 'ｶﾞｷﾞ', '㍿', '漢字かなカナ', '中文，English混合']),
  ];
  return r.repeat(r.int(1, 6), () => r.pick(pieces)() + (r.chance(0.2) ? r.pick(SPACES) : ''));
}

function hangul(r) {
  const pieces = [
    () => r.repeat(r.int(1, 6), () => r.fromRange(0xac00, 0xd7a3)),
    // Conjoining jamo (L V T) compose to syllables under NFC.
    () => r.fromRange(0x1100, 0x1112) + r.fromRange(0x1161, 0x1175) + (r.chance(0.5) ? r.fromRange(0x11a8, 0x11c2) : ''),
    () => r.fromRange(0xac00, 0xd7a3) + r.fromRange(0x11a8, 0x11c2),
    () => r.pick(['안녕하세요', '한국어 텍스트', '서울특별시', 'ㄱㄴㄷ', '대한민국']),
  ];
  return r.repeat(r.int(1, 5), () => r.pick(pieces)() + r.pick([' ', '', '. ', '? ']));
}

function arabic(r) {
  const word = () => r.repeat(r.int(2, 7), () => r.fromRange(0x0621, 0x064a) + (r.chance(0.3) ? r.fromRange(0x064b, 0x0652) : ''));
  return r.repeat(r.int(1, 6), () => word() + r.pick([' ', ' ', '، ', '؟ ', ' ١٢٣ ', '\u200f']));
}

function devanagari(r) {
  const syllable = () => r.fromRange(0x0915, 0x0939) + (r.chance(0.2) ? '\u093c' : '') +
    (r.chance(0.5) ? r.fromRange(0x093e, 0x094c) : '') + (r.chance(0.15) ? '\u094d' : '') + (r.chance(0.1) ? '\u0902' : '');
  return r.repeat(r.int(1, 5), () => r.repeat(r.int(1, 4), syllable) + r.pick([' ', '। ', ' १२ ', ', ']));
}

function combining(r) {
  // Letters followed by combining marks, sometimes out of canonical order: NFC composes and reorders.
  // Some marks are newer than Unicode 9.0, whose tables HF's normalizer uses (it leaves them be).
  const marks = () => r.repeat(r.int(1, 3), () => r.pick([
    r.fromRange(0x0300, 0x036f), '\u0316', '\u0323', '\u0327', '\u1dc0', '\u20d7', '\u0345', '\u05b0', '\u0e31',
    '\u09fe', '\u1df6', '\u1dfa', '\u1abf', '\u1ac1', '\u0898', '\u{1e130}', '\u{10eab}', '\u{10efd}', '\u08d4',
  ]));
  const bases = ['a', 'e', 'o', 'u', 'A', 'n', 'c', 's', 'ω', 'Ж', 'z', ' ', 'ı', '\u{11935}', '\u{11347}', 'ᄀ', '가'];
  return r.repeat(r.int(1, 6), () => r.pick(bases) + marks() + (r.chance(0.2) ? r.pick(['\u{11930}', '\u{1133e}', 'ᅡ', 'ᆨ']) : '')) +
    (r.chance(0.5) ? ' ' + latinSentence(r) : '');
}

function emoji(r) {
  return r.repeat(r.int(1, 6), () => r.pick(EMOJI) + (r.chance(0.4) ? r.pick([' ', '', '\u200d', '\ufe0f', 'ok ', '!']) : ''));
}

function whitespace(r) {
  return r.repeat(r.int(1, 8), () => {
    const run = r.repeat(r.int(1, 5), () => r.pick(SPACES));
    return r.chance(0.7) ? run + r.pick(WORDS) + (r.chance(0.3) ? r.pick(PUNCTUATION) : '') : run;
  });
}

function code(r) {
  return r.repeat(r.int(1, 4), () => r.pick(CODE_TEMPLATES)(r, identifier(r), r.int(0, 100000)));
}

function numbers(r) {
  const number = () => r.pick([
    () => String(r.int(0, 9)),
    () => String(r.int(0, 2 ** 31)),
    () => r.repeat(r.int(5, 40), () => String(r.int(0, 9))),
    () => `${r.int(0, 999)}.${r.int(0, 99999)}`,
    () => r.int(1, 999) + ',' + String(r.int(0, 999)).padStart(3, '0') + ',' + String(r.int(0, 999)).padStart(3, '0'),
    () => `-${r.int(1, 99)}e-${r.int(1, 30)}`,
    () => r.repeat(r.int(1, 6), () => r.fromRange(0xff10, 0xff19)),  // fullwidth digits
    () => r.repeat(r.int(1, 6), () => r.fromRange(0x0660, 0x0669)),  // Arabic-Indic digits
    () => r.pick(['²', '³', '½', 'Ⅻ', '①', '٣', '𝟗', '0x7fff', '1e10', '3.14159', '$1,000', '50%', '#42']),
  ])();
  return r.repeat(r.int(1, 6), () => number() + r.pick([' ', '', ', ', 'px ', ' + ', '\n']));
}

// Blocks assigned after Unicode 14.0, the version of Debian's Oniguruma tables (metrale updates
// them to Unicode 16.0, the oracle's): CJK Extensions H and I, recent scripts, symbols and emoji.
const RECENT_UNICODE = [
  [0x31350, 0x323af],  // CJK Unified Ideographs Extension H (15.0)
  [0x2ebf0, 0x2ee5d],  // CJK Unified Ideographs Extension I (15.1)
  [0x11f00, 0x11f59],  // Kawi (15.0)
  [0x1e4d0, 0x1e4f9],  // Nag Mundari (15.0)
  [0x10efd, 0x10eff],  // Arabic small low marks (15.0)
  [0x1fa70, 0x1faff],  // Symbols and Pictographs Extended-A (emoji through 16.0)
  [0x1cc00, 0x1ceb3],  // Symbols for Legacy Computing Supplement (16.0)
  [0x105c0, 0x105f3],  // Todhri (16.0)
  [0x16d40, 0x16d79],  // Kirat Rai (16.0)
  [0x1e5d0, 0x1e5fa],  // Ol Onal (16.0)
  [0x10d40, 0x10d8f],  // Garay (16.0)
  [0x11380, 0x113e2],  // Tulu-Tigalari (16.0)
];

function recentUnicode(r) {
  return r.repeat(r.int(1, 4), () => {
    const [lo, hi] = r.pick(RECENT_UNICODE);
    return r.pick([' ', '', 'a', 'ab ', '1', '. ', '中']) + r.repeat(r.int(1, 3), () => r.fromRange(lo, hi)) +
      r.pick(['', 'x', ' ', '!', '\u0301']);
  });
}

function fuzz(r) {
  const alphabet = [
    () => r.fromRange(0x20, 0x7e), () => r.fromRange(0x20, 0x7e), () => r.pick(SPACES), () => r.fromRange(0xa0, 0x24f),
    () => r.fromRange(0x0300, 0x036f), () => r.fromRange(0x0370, 0x052f), () => r.fromRange(0x0590, 0x06ff),
    () => r.fromRange(0x0900, 0x0dff), () => r.fromRange(0x1100, 0x11ff), () => r.fromRange(0x2000, 0x2bff),
    () => r.fromRange(0x3000, 0x30ff), () => r.fromRange(0x4e00, 0x9fff), () => r.fromRange(0xac00, 0xd7a3),
    () => r.fromRange(0xe000, 0xe0ff), () => r.fromRange(0xf900, 0xfaff), () => r.fromRange(0xfe00, 0xfe0f),
    () => r.fromRange(0xff00, 0xffef), () => r.fromRange(0x1d400, 0x1d7ff), () => r.fromRange(0x1f300, 0x1faff),
    () => r.fromRange(0x10000, 0x10ffff), () => '\u0000', () => r.fromRange(0x01, 0x1f), () => "'",
  ];
  return r.repeat(r.int(1, 40), () => r.pick(alphabet)());
}

const EDGE_CASES = [
  '', ' ', '  ', '\n', '\r\n', '\t', "'", "'s", "'S", "''''", 's\'', ' \'s', 'a', 'A', '0', '\u0000', '\u00a0',
  'Hello world', 'Hello, world!', "I'M here", "DON'T", "it'S", 'x' + ' '.repeat(10), ' '.repeat(33) + 'x',
  '\n\n\n', '\r\r\n\n', 'a\r\nb', ' \t \n ', '....', '???!!!', '1234567890', '１２３', 'é', 'e\u0301', '\ufeffBOM',
  '\u180e', 'a\u180eb', 'a\u200bb', 'a\u2028b', '\u3000\u3000', 'Ġ', 'Ċ', 'ĠĠ', '▁', '<s>', '</s>', '<unk>', '<pad>',
  '<|', '|>', '<||>', '< |endoftext|>', '<|ENDOFTEXT|>', 'ÿ', '\u00ad', '\u034f', '\u0600', '\ud83d\ude00',
  String.fromCodePoint(0x10ffff), '\uffff', '\ufffd', 'Ã©', 'ð\u009f\u0098\u0080',
];

// A corpus of `count` strings (or more: the edge cases are always included), each tagged with the
// generator that made it. `specialTokens` are the tokenizer's added tokens, mixed into text.
export function buildOracleCorpus(seed, specialTokens, count) {
  const r = makeRng(seed);
  const generators = { latin: latinSentence, accented: latinAccented, cjk, hangul, arabic, devanagari, combining, emoji,
    whitespace, code, numbers, fuzz, recent: recentUnicode };
  const names = Object.keys(generators);
  const special = () => {
    const token = r.pick(specialTokens);
    return r.pick([
      () => token,
      () => ' ' + token + ' ',
      () => token + token,
      () => token.slice(0, r.int(1, Math.max(1, token.length - 1))),  // a prefix only: not a token
      () => '<' + token + '>',
      () => token.toUpperCase(),
      () => '\n' + token + '\n',
    ])();
  };
  const corpus = EDGE_CASES.map((text) => ({ kind: 'edge', text }));
  for (const token of specialTokens) corpus.push({ kind: 'special', text: token });
  while (corpus.length < count) {
    const roll = r.next();
    if (roll < 0.12) {
      // Special tokens inline with other text.
      corpus.push({ kind: 'special', text: r.repeat(r.int(1, 5), () => (r.chance(0.5) ? special() : generators[r.pick(names)](r))) });
    } else if (roll < 0.17) {
      // Long strings: many pieces of every kind.
      corpus.push({ kind: 'long', text: r.repeat(r.int(20, 200), () => (r.chance(0.1) ? special() : generators[r.pick(names)](r) + r.pick(['\n', ' ', '\n\n', '']))) });
    } else if (roll < 0.35) {
      // Mixtures of two or three kinds.
      corpus.push({ kind: 'mixed', text: r.repeat(r.int(2, 3), () => generators[r.pick(names)](r) + r.pick(['', ' ', '\n'])) });
    } else {
      const name = r.pick(names);
      corpus.push({ kind: name, text: generators[name](r) });
    }
  }
  return corpus;
}

// Random id sequences for the decoder: whole tokens, tokens that split a character across ids,
// special tokens and ids outside the vocabulary.
export function buildIdSequences(seed, vocabSize, specialIds, count) {
  const r = makeRng(seed);
  const sequences = [];
  for (let i = 0; i < count; i++) {
    sequences.push(Array.from({ length: r.int(0, 30) }, () => {
      const roll = r.next();
      if (roll < 0.1) return r.pick(specialIds);
      if (roll < 0.4) return r.int(0, 255);  // the single-byte tokens come first in these vocabs
      if (roll < 0.98) return r.int(0, vocabSize - 1);
      return vocabSize + r.int(0, 1000);      // unknown: skipped
    }));
  }
  return sequences;
}

// A realistic benchmark text of about `bytes` bytes: English-like prose, source code, CJK and
// mixed-script paragraphs in proportions typical of chat traffic.
export function buildBenchCorpus(seed, bytes) {
  const r = makeRng(seed);
  const paragraphs = [];
  let size = 0;
  while (size < bytes) {
    const roll = r.next();
    let text;
    if (roll < 0.55) text = r.repeat(r.int(3, 12), () => latinSentence(r) + '. ');
    else if (roll < 0.75) text = code(r) + code(r);
    else if (roll < 0.85) text = r.repeat(r.int(3, 10), () => cjk(r));
    else if (roll < 0.9) text = latinAccented(r) + hangul(r) + arabic(r) + devanagari(r);
    else if (roll < 0.95) text = numbers(r) + emoji(r);
    else text = r.repeat(r.int(2, 6), () => latinSentence(r) + r.pick(PUNCTUATION) + '\n');
    paragraphs.push(text);
    size += Buffer.byteLength(text) + 2;
  }
  return paragraphs.join('\n\n');
}
