// Behaviour of `tandem serve` over loopback HTTP, with node's built-in test runner
// and fetch only. Started by tests/integration/test_serve.sh, which passes TD_URL (the
// main server), TD_SLOW_URL (a server whose engine sleeps 20 ms per step, with
// --max-num-seqs 4 --max-queue 2), TD_MODEL_NAME, TD_BIN and TD_MODEL.
// No test asserts on timing: deadlines only bound waits for state that must arrive.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import net from 'node:net';

const URL_ = process.env.TD_URL;
const SLOW = process.env.TD_SLOW_URL;
const NAME = process.env.TD_MODEL_NAME;
assert.ok(URL_ && SLOW && NAME, 'TD_URL, TD_SLOW_URL and TD_MODEL_NAME must be set');

async function post(path, body, base = URL_) {
  const res = await fetch(base + path, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: typeof body === 'string' || Buffer.isBuffer(body) ? body : JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: res.status, json, text, headers: res.headers };
}

const complete = (body) => post('/v1/completions', { max_tokens: 16, temperature: 0, ...body });

// Read an SSE response: returns the parsed events (objects) and checks the framing.
async function stream(path, body, base = URL_) {
  const res = await fetch(base + path, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, stream: true }),
  });
  assert.equal(res.status, 200, await (res.status !== 200 ? res.text() : ''));
  assert.match(res.headers.get('content-type'), /^text\/event-stream/);
  const raw = await res.text();
  assert.ok(raw.endsWith('data: [DONE]\n\n'), `stream must end with [DONE]: ${raw.slice(-80)}`);
  const blocks = raw.split('\n\n').filter((b) => b.length);
  const events = [];
  for (const [i, b] of blocks.entries()) {
    assert.ok(b.startsWith('data: '), `event ${i} is not a data line: ${b}`);
    const payload = b.slice(6);
    if (payload === '[DONE]') {
      assert.equal(i, blocks.length - 1, '[DONE] must be last');
      continue;
    }
    events.push(JSON.parse(payload));
  }
  return events;
}

const streamText = (events, index = 0) =>
  events.flatMap((e) => e.choices.filter((c) => c.index === index))
    .map((c) => c.text ?? c.delta?.content ?? '').join('');

const cliGreedy = (ids, n) =>
  execFileSync(process.env.TD_BIN, ['generate', '--model', process.env.TD_MODEL, '--prompt-ids',
    ids.join(','), '-n', String(n), '--threads', '1', '--log-level', 'warn', '--ignore-eos'],
  { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] }).replace(/\n$/, '');

async function metric(name, base = URL_) {
  const text = await (await fetch(base + '/metrics')).text();
  const m = text.match(new RegExp(`^${name}(\\{[^}]*\\})? ([0-9.e+-]+)$`, 'm'));
  assert.ok(m, `metric ${name} missing`);
  return Number(m[2]);
}

test('token-id prompt: greedy text equals `tandem generate`', async () => {
  const ids = [1, 306, 463];
  const r = await complete({ prompt: ids, max_tokens: 24, ignore_eos: true });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.object, 'text_completion');
  assert.equal(r.json.model, NAME);
  assert.match(r.json.id, /^cmpl-/);
  assert.equal(typeof r.json.created, 'number');
  assert.equal(r.json.choices.length, 1);
  assert.equal(r.json.choices[0].text, cliGreedy(ids, 24));
  assert.equal(r.json.choices[0].finish_reason, 'length');
  assert.deepEqual(
    [r.json.usage.prompt_tokens, r.json.usage.completion_tokens, r.json.usage.total_tokens],
    [3, 24, 27]);
  for (const k of ['queue_time_ms', 'ttft_ms', 'tpot_ms', 'e2e_ms'])
    assert.equal(typeof r.json.usage.timings[k], 'number', k);
});

test('string prompt, echo, and batched prompts agree with single requests', async () => {
  const a = await complete({ prompt: 'Once upon a time', max_tokens: 8 });
  assert.equal(a.status, 200, a.text);
  assert.ok(a.json.usage.prompt_tokens > 1);
  const e = await complete({ prompt: 'Once upon a time', max_tokens: 8, echo: true });
  assert.equal(e.json.choices[0].text, 'Once upon a time' + a.json.choices[0].text);
  const b = await complete({ prompt: [1, 400, 401], max_tokens: 8 });
  const batch = await complete({ prompt: [[1, 306, 463], [1, 400, 401]], max_tokens: 8 });
  assert.equal(batch.status, 200, batch.text);
  assert.equal(batch.json.choices.length, 2);
  assert.equal(batch.json.choices[1].text, b.json.choices[0].text);
  assert.equal(batch.json.choices[0].index, 0);
  assert.equal(batch.json.choices[1].index, 1);
  const strs = await complete({ prompt: ['Once upon a time', 'Once upon a time'], max_tokens: 8 });
  assert.equal(strs.json.choices[0].text, a.json.choices[0].text);
  assert.equal(strs.json.choices[1].text, a.json.choices[0].text);
  assert.equal(strs.json.usage.prompt_tokens, 2 * a.json.usage.prompt_tokens);
});

test('streaming: framing, text equal to the non-streamed text, usage chunk, [DONE]', async () => {
  const body = { prompt: [1, 306, 463], max_tokens: 20, temperature: 0, ignore_eos: true };
  const full = await complete(body);
  const ev = await stream('/v1/completions', { ...body, stream_options: { include_usage: true } });
  assert.equal(streamText(ev), full.json.choices[0].text);
  for (const e of ev) {
    assert.equal(e.object, 'text_completion');
    assert.equal(e.id, ev[0].id);
  }
  const finals = ev.filter((e) => e.choices.length && e.choices[0].finish_reason);
  assert.equal(finals.length, 1);
  assert.equal(finals[0].choices[0].finish_reason, 'length');
  const last = ev[ev.length - 1];
  assert.deepEqual(last.choices, []);
  for (const e of ev.slice(0, -1)) assert.equal(e.usage, null, 'usage: null until the usage chunk');
  assert.equal(last.usage.completion_tokens, 20);
  assert.equal(last.usage.prompt_tokens, 3);
  // without include_usage, no usage chunk
  const ev2 = await stream('/v1/completions', body);
  assert.ok(ev2.every((e) => !e.usage));
});

test('chat completions, plain and streamed', async () => {
  const body = { messages: [{ role: 'system', content: 'Be brief.' },
    { role: 'user', content: [{ type: 'text', text: 'Tell me a story.' }] }],
  max_tokens: 12, temperature: 0 };
  const r = await post('/v1/chat/completions', body);
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.object, 'chat.completion');
  assert.match(r.json.id, /^chatcmpl-/);
  assert.equal(r.json.choices[0].message.role, 'assistant');
  assert.equal(typeof r.json.choices[0].message.content, 'string');
  assert.ok(r.json.usage.prompt_tokens > 10);
  const ev = await stream('/v1/chat/completions', body);
  assert.equal(ev[0].object, 'chat.completion.chunk');
  assert.equal(ev[0].choices[0].delta.role, 'assistant');
  assert.equal(streamText(ev), r.json.choices[0].message.content);
  assert.equal(ev[ev.length - 1].choices[0].finish_reason, r.json.choices[0].finish_reason);
});

test('stop strings end the text before the stop string', async () => {
  const full = await complete({ prompt: [1, 306, 463], max_tokens: 30, ignore_eos: true });
  const text = full.json.choices[0].text;
  const stop = text.slice(10, 13);
  const cut = text.indexOf(stop);
  for (const s of [stop, [stop, 'zzzz-not-there']]) {
    const r = await complete({ prompt: [1, 306, 463], max_tokens: 30, ignore_eos: true, stop: s });
    assert.equal(r.json.choices[0].text, text.slice(0, cut));
    assert.equal(r.json.choices[0].finish_reason, 'stop');
  }
});

test('penalties and logit_bias change the text; unsupported OpenAI fields are a 400', async () => {
  const base = { prompt: [1, 306, 463], max_tokens: 20, temperature: 0, ignore_eos: true };
  const plain = (await complete(base)).json.choices[0].text;
  for (const extra of [{ frequency_penalty: 2 }, { presence_penalty: 2 }, { repetition_penalty: 1.5 }]) {
    const r = await complete({ ...base, ...extra });
    assert.equal(r.status, 200, r.text);
    assert.notEqual(r.json.choices[0].text, plain, JSON.stringify(extra));
    assert.equal((await complete({ ...base, ...extra })).json.choices[0].text, r.json.choices[0].text);
  }
  // A token pushed up by 100 wins every step; the log-probabilities stay the model's.
  const b = await complete({ ...base, max_tokens: 4, logit_bias: { 400: 100 }, logprobs: 1 });
  assert.equal(b.status, 200, b.text);
  const lp = b.json.choices[0].logprobs;
  assert.equal(new Set(lp.tokens).size, 1);
  assert.ok(lp.token_logprobs[0] < -0.01, 'the raw log-probability of a token the model did not favour');
  for (const [body, param] of [[{ ...base, logit_bias: { 99999: 1 } }, null], [{ ...base, response_format: { type: 'json_object' } }, 'response_format'],
    [{ ...base, echo: true, logprobs: 1 }, 'logprobs'], [{ ...base, presence_penalty: 'x' }, 'presence_penalty']]) {
    const r = await complete(body);
    assert.equal(r.status, 400, r.text);
    if (param) assert.equal(r.json.error.param, param);
  }
});

test('seeded sampling is reproducible; n gives distinct seeded choices', async () => {
  const body = { prompt: [1, 306], max_tokens: 24, temperature: 1, ignore_eos: true };
  const a = await complete({ ...body, seed: 1234 });
  const b = await complete({ ...body, seed: 1234 });
  assert.equal(a.json.choices[0].text, b.json.choices[0].text);
  const outs = new Set();
  for (const seed of [1, 2, 3, 4, 5]) outs.add((await complete({ ...body, seed })).json.choices[0].text);
  assert.ok(outs.size > 1, 'different seeds should not all agree');
  const n1 = await complete({ ...body, seed: 99, n: 3 });
  const n2 = await complete({ ...body, seed: 99, n: 3 });
  assert.equal(n1.json.choices.length, 3);
  assert.deepEqual(n1.json.choices.map((c) => c.text), n2.json.choices.map((c) => c.text));
  assert.equal(n1.json.usage.completion_tokens, 72);
});

test('logprobs: tokens and top alternatives in OpenAI shape', async () => {
  const r = await complete({ prompt: [1, 306], max_tokens: 4, logprobs: 2 });
  const lp = r.json.choices[0].logprobs;
  assert.equal(lp.tokens.length, 4);
  assert.equal(lp.token_logprobs.length, 4);
  assert.equal(lp.top_logprobs.length, 4);
  assert.deepEqual(lp.text_offset.length, 4);
  assert.equal(lp.tokens.join(''), r.json.choices[0].text);
  // text_offset: where each token starts, in characters (code points, as vLLM counts);
  // the same with a stop string that holds text back and never matches.
  const offsets = (tokens) => tokens.map((t, i) => tokens.slice(0, i).reduce((a, x) => a + [...x].length, 0));
  assert.deepEqual(lp.text_offset, offsets(lp.tokens));
  // (the first token's last character is held back as the start of the stop string)
  const held = await complete({ prompt: [1, 306], max_tokens: 4, logprobs: 2, stop: [lp.tokens[0].slice(-1) + '\u0001'] });
  assert.equal(held.json.choices[0].text, r.json.choices[0].text);
  assert.deepEqual(held.json.choices[0].logprobs.text_offset, lp.text_offset);
  // Each top_logprobs object names a text once, though byte tokens all print as U+FFFD
  // (checked on the raw body: JSON.parse would keep one of two equal keys silently).
  const wide = await complete({ prompt: 'Once upon a time', max_tokens: 8, logprobs: 20 });
  const raw = wide.text;
  const objs = raw.slice(raw.indexOf('"top_logprobs"')).match(/\{[^{}]*\}/g);
  assert.ok(objs.length >= 8);
  let fffd = 0;
  for (const o of objs) {
    const keys = [...o.matchAll(/"((?:[^"\\]|\\.)*)":/g)].map((m) => m[1]);
    assert.equal(new Set(keys).size, keys.length, `a key twice in ${o}`);
    fffd += keys.some((k) => JSON.parse(`"${k}"`) === '\ufffd');
  }
  assert.ok(fffd > 0, 'byte tokens among the alternatives');
  for (const t of lp.token_logprobs) assert.ok(t <= 0);
  const c = await post('/v1/chat/completions', { messages: [{ role: 'user', content: 'hi' }],
    max_tokens: 3, temperature: 0, logprobs: true, top_logprobs: 2 });
  assert.equal(c.status, 200, c.text);
  assert.equal(c.json.choices[0].logprobs.content.length, 3);
});

// Parameters that ask for no disaggregation are echoed as given (do_remote_decode and
// do_remote_prefill are tested with real producers and consumers in pd.test.mjs).
test('kv_transfer_params is kept with the request and echoed back', async () => {
  const kv = { do_remote_decode: false, do_remote_prefill: false, nested: { x: [1, 2] } };
  const r = await complete({ prompt: [1, 306], max_tokens: 1, kv_transfer_params: kv,
    some_unknown_field: { ignored: true } });
  assert.equal(r.status, 200, r.text);
  assert.deepEqual(r.json.kv_transfer_params, kv);
});

test('32 concurrent streams complete and agree with sequential results', async () => {
  const prompts = Array.from({ length: 32 }, (_, i) => [1, 300 + i, 20 + i]);
  const body = (p) => ({ prompt: p, max_tokens: 24, temperature: 0, ignore_eos: true });
  const sequential = [];
  for (const p of prompts) sequential.push((await complete(body(p))).json.choices[0].text);
  const streamed = await Promise.all(prompts.map((p) => stream('/v1/completions', body(p))));
  assert.deepEqual(streamed.map((ev) => streamText(ev)), sequential);
});

test('discovery endpoints: /v1/models, /server_info, /kv_transfer_info, /metrics', async () => {
  const m = await (await fetch(URL_ + '/v1/models')).json();
  assert.equal(m.object, 'list');
  assert.equal(m.data[0].id, NAME);
  for (const path of ['/server_info', '/kv_transfer_info']) {
    const j = await (await fetch(URL_ + path)).json();
    assert.equal(j.model, NAME);
    assert.equal(j.block_size, 16);
    assert.equal(j.kv_dtype, 'f16');
    assert.equal(j.tp_size, 1);
    assert.equal(j.dp_size, 1);
    assert.equal(j.kv_role, 'kv_producer');
    assert.equal(j.handshake_port, 5601);
  }
  const text = await (await fetch(URL_ + '/metrics')).text();
  for (const name of ['tandem_num_requests_running', 'tandem_num_requests_waiting',
    'tandem_kv_blocks_used', 'tandem_kv_blocks_total', 'tandem_prefix_cache_hit_rate',
    'tandem_prompt_tokens_total', 'tandem_generation_tokens_total',
    'tandem_time_to_first_token_seconds_bucket', 'tandem_time_per_output_token_seconds_bucket',
    'tandem_e2e_request_latency_seconds_bucket'])
    assert.ok(text.includes(name), `metrics lack ${name}`);
  assert.ok(await metric('tandem_generation_tokens_total') > 0);
  assert.ok(await metric('tandem_kv_blocks_total') > 0);
  // The engine's steps: each one in the histograms, and time in both kinds by now.
  const steps = await metric('tandem_engine_steps_total\\{[^}]*kind="prefill"\\}') +
    await metric('tandem_engine_steps_total\\{[^}]*kind="decode"\\}');
  assert.ok(steps > 0);
  assert.equal(await metric('tandem_iteration_tokens_count'), steps);
  assert.equal(await metric('tandem_engine_step_duration_seconds_bucket\\{[^}]*le="\\+Inf"\\}'), steps);
  assert.ok(await metric('tandem_iteration_tokens_sum') >= steps);
  assert.ok(await metric('tandem_engine_step_seconds_total\\{[^}]*kind="prefill"\\}') > 0);
  assert.ok(await metric('tandem_engine_step_seconds_total\\{[^}]*kind="decode"\\}') > 0);
});

test('client disconnect aborts the request and frees its KV blocks', async () => {
  const aborts = await metric('tandem_request_success_total\\{[^}]*finished_reason="abort"\\}', SLOW)
    .catch(() => 0);
  const ctrl = new AbortController();
  const res = await fetch(SLOW + '/v1/completions', {
    method: 'POST', signal: ctrl.signal, headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt: [1, 306, 463], max_tokens: 120, temperature: 0,
      ignore_eos: true, stream: true }),
  });
  const reader = res.body.getReader();
  await reader.read(); // the first chunk: the request is running
  assert.ok(await metric('tandem_kv_blocks_used', SLOW) > 0, 'a running request holds blocks');
  ctrl.abort();
  const deadline = Date.now() + 30000;
  let used = -1;
  while (Date.now() < deadline) {
    used = await metric('tandem_kv_blocks_used', SLOW);
    if (used === 0) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(used, 0, 'blocks are freed after the disconnect');
  const after = await metric('tandem_request_success_total\\{[^}]*finished_reason="abort"\\}', SLOW);
  assert.equal(after, aborts + 1, 'the request was aborted, not run to its end');
  assert.equal(await metric('tandem_num_requests_running', SLOW), 0);
});

test('a client that hangs up before a non-streamed reply has its request aborted', async () => {
  const abortMetric = 'tandem_request_success_total\\{[^}]*finished_reason="abort"\\}';
  const before = await metric(abortMetric, SLOW);
  const u = new URL(SLOW);
  const body = JSON.stringify({ prompt: [1, 306], max_tokens: 120, ignore_eos: true });
  const sock = net.connect(Number(u.port), u.hostname);
  await new Promise((r) => sock.on('connect', r));
  sock.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n` +
    `Content-Length: ${body.length}\r\n\r\n${body}`);
  const deadline = Date.now() + 30000;
  while (Date.now() < deadline && await metric('tandem_num_requests_running', SLOW) === 0)
    await new Promise((r) => setTimeout(r, 20));
  sock.destroy();
  let after = before;
  while (Date.now() < deadline) {
    after = await metric(abortMetric, SLOW);
    if (after > before && await metric('tandem_kv_blocks_used', SLOW) === 0) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(after, before + 1);
  assert.equal(await metric('tandem_kv_blocks_used', SLOW), 0);
});

test('a full waiting queue answers 429; a request that could never fit, 400', async () => {
  // 4 running + 2 waiting fill the slow server (20 ms a step) for about a second.
  const busy = post('/v1/completions', { prompt: [1, 2], max_tokens: 40, ignore_eos: true, n: 6 }, SLOW);
  await new Promise((r) => setTimeout(r, 100));
  const r = await post('/v1/completions', { prompt: [1, 2], max_tokens: 2 }, SLOW);
  assert.equal(r.status, 429, r.text);
  assert.equal(r.json.error.type, 'rate_limit_error');
  assert.equal((await busy).status, 200);
  // More sequences than running + waiting slots is no "retry later": a 400 naming n.
  const never = await post('/v1/completions', { prompt: [1, 2], max_tokens: 2, n: 7 }, SLOW);
  assert.equal(never.status, 400, never.text);
  assert.equal(never.json.error.param, 'n');
  assert.match(never.json.error.message, /at most 6 at once/);
  const ok = await post('/v1/completions', { prompt: [1, 2], max_tokens: 2 }, SLOW);
  assert.equal(ok.status, 200);
});

// Each: [name, path, body (string | Buffer | object), expected status, param (optional)]
const deep = '['.repeat(100000) + ']'.repeat(100000);
const bad = [
  ['broken JSON', '/v1/completions', '{"prompt": [1, 2', 400],
  ['empty body', '/v1/completions', '', 400],
  ['array body', '/v1/completions', '[1,2]', 400],
  ['string body', '/v1/completions', '"hello"', 400],
  ['trailing garbage', '/v1/completions', '{"prompt":[1]} xyz', 400],
  ['100k-deep nesting', '/v1/completions', deep, 400],
  ['deep nesting in a field', '/v1/completions', `{"prompt":${'['.repeat(40)}1${']'.repeat(40)}}`, 400],
  ['10 MB body', '/v1/completions', Buffer.alloc(10 << 20, 0x61), 413],
  ['prompt missing', '/v1/completions', { max_tokens: 2 }, 400, 'prompt'],
  ['prompt a number', '/v1/completions', { prompt: 5 }, 400, 'prompt'],
  ['prompt empty array', '/v1/completions', { prompt: [] }, 400, 'prompt'],
  ['prompt mixed array', '/v1/completions', { prompt: ['a', 1] }, 400, 'prompt'],
  ['prompt nested mixed', '/v1/completions', { prompt: [[1, 2], 'a'] }, 400, 'prompt'],
  ['token id outside the vocabulary', '/v1/completions', { prompt: [1, 99999] }, 400, 'prompt'],
  ['negative token id', '/v1/completions', { prompt: [1, -5] }, 400, 'prompt'],
  ['fractional token id', '/v1/completions', { prompt: [1, 2.5] }, 400, 'prompt'],
  ['negative max_tokens', '/v1/completions', { prompt: [1], max_tokens: -1 }, 400, 'max_tokens'],
  ['zero max_tokens', '/v1/completions', { prompt: [1], max_tokens: 0 }, 400, 'max_tokens'],
  ['string max_tokens', '/v1/completions', { prompt: [1], max_tokens: '10' }, 400, 'max_tokens'],
  ['max_tokens beyond the context', '/v1/completions', { prompt: [1, 2], max_tokens: 500 }, 400, 'max_tokens'],
  ['NaN temperature', '/v1/completions', '{"prompt":[1],"temperature":NaN}', 400],
  ['infinite temperature', '/v1/completions', '{"prompt":[1],"temperature":1e999}', 400, 'temperature'],
  ['negative temperature', '/v1/completions', { prompt: [1], temperature: -0.5 }, 400, 'temperature'],
  ['top_p zero', '/v1/completions', { prompt: [1], top_p: 0 }, 400, 'top_p'],
  ['top_p above one', '/v1/completions', { prompt: [1], top_p: 1.5 }, 400, 'top_p'],
  ['min_p a string', '/v1/completions', { prompt: [1], min_p: 'x' }, 400, 'min_p'],
  ['huge n', '/v1/completions', { prompt: [1], n: 1000000 }, 400, 'n'],
  ['zero n', '/v1/completions', { prompt: [1], n: 0 }, 400, 'n'],
  ['too many choices', '/v1/completions', { prompt: Array(100).fill([1, 2]), n: 8 }, 400, 'n'],
  ['stop a number', '/v1/completions', { prompt: [1], stop: 5 }, 400, 'stop'],
  ['too many stops', '/v1/completions', { prompt: [1], stop: Array(40).fill('x') }, 400, 'stop'],
  ['empty stop string', '/v1/completions', { prompt: [1], stop: [''] }, 400, 'stop'],
  ['stream not a boolean', '/v1/completions', { prompt: [1], stream: 'yes' }, 400, 'stream'],
  ['logprobs too large', '/v1/completions', { prompt: [1], logprobs: 100 }, 400, 'logprobs'],
  ['fractional seed', '/v1/completions', { prompt: [1], seed: 1.5 }, 400, 'seed'],
  ['kv_transfer_params not an object', '/v1/completions', { prompt: [1], kv_transfer_params: 3 }, 400, 'kv_transfer_params'],
  ['invalid UTF-8', '/v1/completions', Buffer.from([0x7b, 0x22, 0x70, 0x72, 0x6f, 0x6d, 0x70, 0x74, 0x22, 0x3a, 0x22, 0xff, 0xfe, 0x22, 0x7d]), 400],
  ['lone surrogate escape', '/v1/completions', '{"prompt":"\\ud800"}', 400],
  ['NUL byte', '/v1/completions', Buffer.from('{"prompt":"a\u0000b"}'), 400],
  ['unknown model', '/v1/completions', { prompt: [1], model: 'gpt-4' }, 404, 'model'],
  ['chat without messages', '/v1/chat/completions', { max_tokens: 2 }, 400, 'messages'],
  ['chat with a bad role', '/v1/chat/completions', { messages: [{ role: 'wizard', content: 'x' }] }, 400, 'messages.role'],
  ['chat content a number', '/v1/chat/completions', { messages: [{ role: 'user', content: 7 }] }, 400, 'messages.content'],
  ['chat top_logprobs without logprobs', '/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], top_logprobs: 2 }, 400, 'top_logprobs'],
];

test(`${bad.length} malformed or hostile requests get the right status and an error body`, async () => {
  for (const [name, path, body, status, param] of bad) {
    const r = await post(path, body);
    assert.equal(r.status, status, `${name}: got ${r.status} ${r.text.slice(0, 200)}`);
    assert.ok(r.json && r.json.error, `${name}: no error body: ${r.text.slice(0, 200)}`);
    assert.equal(typeof r.json.error.message, 'string', name);
    assert.ok(r.json.error.message.length > 0, name);
    assert.equal(typeof r.json.error.type, 'string', name);
    assert.ok('param' in r.json.error && 'code' in r.json.error, name);
    if (param) assert.equal(r.json.error.param, param, `${name}: ${r.json.error.message}`);
  }
  // Routing errors.
  assert.equal((await fetch(URL_ + '/v1/nothing')).status, 404);
  const get = await fetch(URL_ + '/v1/completions');
  assert.equal(get.status, 405);
  assert.ok((await get.json()).error.message.includes('POST'));
  assert.equal((await fetch(URL_ + '/health', { method: 'POST' })).status, 405);
  assert.equal((await fetch(URL_ + '/v1/models', { method: 'DELETE' })).status, 405);
  // And the server still serves.
  assert.equal((await fetch(URL_ + '/health')).status, 200);
  const ok = await complete({ prompt: [1, 306], max_tokens: 2 });
  assert.equal(ok.status, 200);
});
