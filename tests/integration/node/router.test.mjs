// `tandem router` in front of real `tandem serve` instances (stories260K, loopback):
// output through the router equals one aggregated engine's, token for token, in
// aggregated mode, PD read mode (1P1D and 2P2D) and PD write mode, streamed (the official
// openai client, SSE framing and [DONE] intact) and not. Then the failures: a prefill
// killed (the other one takes over), the only decode killed (a clear 5xx), a hung
// prefill (SIGSTOP: 504 within the timeout), a client that hangs up (both engines free
// their blocks), bad requests (the engines' error shapes), a wrong API key (401),
// workers added, removed and restarted at run time, and processes out of descriptors
// (accepting again; an engine's heartbeats resuming). Started by test_router.sh.
// No test asserts on timing: deadlines only bound waits for state that must arrive.
import { test, after } from 'node:test';
import { metrics, until, startTandem, refText, freePort } from './lib.mjs';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import http from 'node:http';
import net from 'node:net';
import OpenAI from 'openai';

const BIN = process.env.TD_BIN;
const MODEL = process.env.TD_MODEL;
assert.ok(BIN && MODEL, 'TD_BIN and TD_MODEL must be set');

const procs = new Set();
after(() => { for (const p of procs) p.kill('SIGKILL'); });

const start = (args, env = {}) => startTandem(BIN, args, procs, env);

const serve = (kv, extra = []) => start(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1',
  '--server-port', '0', '--log-level', 'warn', ...(kv ? ['--kv-transfer-config', JSON.stringify(kv)] : []), ...extra]);
const router = (args) => start(['router', '--host', '127.0.0.1', '--port', '0', '--log-level', 'warn',
  '--health-check-interval-secs', '0.2', '--health-check-timeout-secs', '1', '--retry-initial-backoff-secs', '0.01', ...args]);

async function post(base, path, body, headers = {}) {
  const res = await fetch(base + path, {
    method: 'POST', headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: res.status, json, text, headers: res.headers };
}

async function idle(base, what) {
  await until(async () => {
    const m = await metrics(base);
    return m.tandem_kv_blocks_used === 0 && !(m.tandem_kv_leases_active > 0) && m.tandem_num_requests_running === 0;
  }, `${what}: idle with every KV block back`);
}

async function workers(base) {
  return (await (await fetch(base + '/workers')).json()).workers;
}

// Prompts as token ids (BOS first) of varied lengths (stories260K's context is 128).
function prompts(n = 12) {
  const lens = [1, 3, 16, 17, 33, 48, 70, 100];
  const out = [];
  for (let i = 0; i < n; i++) {
    const len = lens[i % lens.length];
    const ids = [1];
    let s = 4242 + i * 7919;
    for (let k = 1; k < len; k++) { s = (s * 1103515245 + 12345) % 2147483648; ids.push(3 + (s % 500)); }
    out.push(ids);
  }
  return out;
}
const GEN = { max_tokens: 10, temperature: 0, ignore_eos: true };

let AGG, P1, P2, D1, D2, PW, R1, R2, RA, RW;
const expected = refText(() => AGG.url, GEN);

// Read an SSE response: the data events, checking the framing on the way.
async function sse(res) {
  const text = await res.text();
  assert.ok(text.endsWith('\n\n'), 'the stream ends with a blank line');
  const events = text.split('\n\n').filter((e) => e.length);
  for (const e of events) assert.ok(e.startsWith('data: '), `an SSE data event: ${JSON.stringify(e)}`);
  assert.equal(events.at(-1), 'data: [DONE]', 'the last event is [DONE]');
  return events.slice(0, -1).map((e) => JSON.parse(e.slice(6)));
}

test('start the engines and the routers', async () => {
  [AGG, P1, P2, D1, D2, PW] = await Promise.all([
    serve(null),
    serve({ kv_role: 'kv_producer' }),
    serve({ kv_role: 'kv_producer' }),
    serve({ kv_role: 'kv_consumer', transfer_timeout_ms: 3000 }),
    serve({ kv_role: 'kv_consumer', transfer_timeout_ms: 3000 }),
    serve({ kv_role: 'kv_producer', transfer_mode: 'write' }),
  ]);
  [R1, R2, RA, RW] = await Promise.all([
    router(['--pd-disaggregation', '--prefill', P1.url, '--decode', D1.url, '--policy', 'random', '--backend', 'atom']),
    router(['--pd-disaggregation', '--prefill', P1.url, '--prefill', P2.url, '--decode', D1.url, '--decode', D2.url,
      '--prefill-policy', 'round_robin', '--decode-policy', 'power_of_two']),
    router(['--worker', AGG.url, '--policy', 'cache_aware']),
    router(['--pd-disaggregation', '--prefill', PW.url, '--decode', D2.url]),
  ]);
  for (const r of [R1, R2, RA, RW])
    await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  const ws = await workers(R2.url);
  assert.equal(ws.length, 4);
  for (const w of ws) {
    assert.equal(w.healthy, true);
    assert.equal(w.ready, true, JSON.stringify(w));
    assert.equal(w.circuit_breaker, 'closed');
  }
  assert.equal((await workers(RW.url)).find((w) => w.role === 'prefill').transfer_mode, 'write');
});

for (const [name, get] of [['aggregated', () => RA], ['1P1D', () => R1], ['2P2D', () => R2], ['write mode', () => RW]]) {
  test(`${name}: output equals one engine's, non-streamed and streamed`, async () => {
    const r = get();
    // The engines are shared between routers: let this router see the last test's
    // load drain away, or power_of_two rightly sends everything to the other decode.
    await until(async () => (await workers(r.url)).every((w) => w.load === 0), 'the workers report no load');
    const ps = prompts();
    const res = await Promise.all(ps.map((p) => post(r.url, '/v1/completions', { prompt: p, ...GEN })));
    for (let i = 0; i < ps.length; i++) {
      assert.equal(res[i].status, 200, res[i].text);
      assert.equal(res[i].json.choices[0].text, await expected(ps[i]), `prompt ${i}`);
      if (name !== 'aggregated') assert.equal(res[i].json.kv_transfer_params.kv_load, 'transferred', res[i].text);
    }
    // Streamed: the events put the same text together, one id throughout, [DONE] last.
    for (const p of ps.slice(0, 6)) {
      const s = await fetch(r.url + '/v1/completions', { method: 'POST', headers: { 'content-type': 'application/json', 'x-request-id': `t-${p.length}` },
        body: JSON.stringify({ prompt: p, ...GEN, stream: true, stream_options: { include_usage: true } }) });
      assert.equal(s.status, 200);
      assert.match(s.headers.get('content-type'), /text\/event-stream/);
      const ev = await sse(s);
      const text = ev.map((e) => (e.choices[0] ? e.choices[0].text : '')).join('');
      assert.equal(text, await expected(p));
      assert.equal(new Set(ev.map((e) => e.id)).size, 1, 'one id in the stream');
      assert.equal(ev.at(-1).usage.completion_tokens, 10);
      for (const e of ev.slice(0, -1)) assert.equal(e.usage, null, 'usage: null until the usage chunk');
      assert.equal(ev.filter((e) => e.choices[0] && e.choices[0].finish_reason).length, 1);
    }
  });
}

test('PD: a request with several choices is computed by a decode instance as a whole', async () => {
  const ps = prompts(3);
  const res = await post(R1.url, '/v1/completions', { prompt: ps, ...GEN });
  assert.equal(res.status, 200, res.text);
  for (let i = 0; i < 3; i++) assert.equal(res.json.choices[i].text, await expected(ps[i]));
  const n2 = await post(R1.url, '/v1/completions', { prompt: ps[0], ...GEN, n: 2 });
  assert.equal(n2.status, 200, n2.text);
  assert.equal(n2.json.choices.length, 2);
});

test('2P2D spreads the work over both prefills and both decodes', async () => {
  const ws = await workers(R2.url);
  for (const w of ws) assert.ok(w.requests > 0, `${w.role} ${w.url} took requests`);
});

test('idx2idx pairs the i-th prefill with the i-th decode', async () => {
  const r = await router(['--pd-disaggregation', '--prefill', P1.url, '--prefill', P2.url, '--decode', D1.url,
    '--decode', D2.url, '--prefill-policy', 'round_robin', '--atom-pd-rank-mapping-policy', 'idx2idx']);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  for (const p of prompts(6)) {
    const res = await post(r.url, '/v1/completions', { prompt: p, ...GEN });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.choices[0].text, await expected(p));
  }
  const ws = await workers(r.url);
  const n = (url) => ws.find((w) => w.url === url).requests;
  assert.equal(n(P1.url), n(D1.url));
  assert.equal(n(P2.url), n(D2.url));
  assert.equal(n(P1.url) + n(P2.url), 6);
  r.proc.kill('SIGTERM');
  // A prefill that fails (dead, but not yet known so: no health check in this run) is
  // retried on the other one, and the decode is the twin of the prefill that answered (which
  // holds the KV), not of the first pick.
  const dead = await serve({ kv_role: 'kv_producer' });
  const r2 = await router(['--pd-disaggregation', '--prefill', dead.url, '--prefill', P2.url, '--decode', D1.url,
    '--decode', D2.url, '--prefill-policy', 'round_robin', '--atom-pd-rank-mapping-policy', 'idx2idx',
    '--health-check-interval-secs', '600', '--cb-failure-threshold', '100']);
  await until(async () => (await fetch(r2.url + '/health')).status === 200, 'router healthy');
  const gone = new Promise((ok) => dead.proc.on('exit', ok));
  dead.proc.kill('SIGKILL');
  await gone;
  for (const p of prompts(4)) {
    const res = await post(r2.url, '/v1/completions', { prompt: p, ...GEN });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.choices[0].text, await expected(p));
  }
  const ws2 = await workers(r2.url);
  const n2 = (url) => ws2.find((w) => w.url === url).requests;
  assert.equal(n2(D2.url), 4, JSON.stringify(ws2.map((w) => [w.url, w.requests])));
  assert.equal(n2(D1.url), 0);
  r2.proc.kill('SIGTERM');
});

test('--dp-aware: an engine with two data-parallel ranks is two workers, each request names its rank', async () => {
  // tandem engines run one rank each (dp_size 1), so a backend with dp_size 2 is played by
  // a small stand-in that answers with the data_parallel_rank each request named.
  const seen = [];
  let health = '{"status":"ok","load":0}';
  const stub = http.createServer((req, res) => {
    let body = '';
    req.on('data', (d) => { body += d; });
    req.on('end', () => {
      res.setHeader('content-type', 'application/json');
      if (req.url === '/health') return res.end(health);
      if (req.url === '/kv_transfer_info') return res.end('{"kv_role":"none","model":"dp-stub","dp_size":2}');
      const rank = JSON.parse(body).data_parallel_rank;
      seen.push(rank);
      res.end(JSON.stringify({ id: 'x', object: 'text_completion', created: 0, model: 'dp-stub',
        choices: [{ index: 0, text: `rank ${rank}`, finish_reason: 'length' }] }));
    });
  });
  await new Promise((ok) => stub.listen(0, '127.0.0.1', ok));
  const url = `http://127.0.0.1:${stub.address().port}`;
  const r = await router(['--worker', url, '--dp-aware', '--policy', 'round_robin']);
  await until(async () => (await workers(r.url)).length === 2, 'one worker per rank');
  assert.deepEqual((await workers(r.url)).map((w) => w.dp_rank).sort(), [0, 1]);
  for (let i = 0; i < 4; i++) assert.equal((await post(r.url, '/v1/completions', { prompt: 'x', max_tokens: 1 })).status, 200);
  assert.deepEqual(seen.slice(-4).sort(), [0, 0, 1, 1]);
  // One series per rank in /metrics (the ranks share a URL): no duplicates, which a
  // Prometheus scrape would reject.
  const samples = (await (await fetch(r.url + '/metrics')).text()).split('\n')
    .filter((l) => l && !l.startsWith('#')).map((l) => l.slice(0, l.lastIndexOf(' ')));
  assert.equal(new Set(samples).size, samples.length, 'duplicate series');
  assert.ok(samples.some((l) => l.includes('dp_rank="1"')), 'a dp_rank label');
  r.proc.kill('SIGTERM');
  // prefix_hash tells the ranks apart (they share a URL; the ring hashes url@rank) ...
  const ph = await router(['--worker', url, '--dp-aware', '--policy', 'prefix_hash']);
  await until(async () => (await workers(ph.url)).length === 2, 'one worker per rank');
  const from = seen.length;
  for (let i = 0; i < 16; i++)
    assert.equal((await post(ph.url, '/v1/completions', { prompt: `${i}: a story about a cat`, max_tokens: 1 })).status, 200);
  assert.deepEqual([...new Set(seen.slice(from))].sort(), [0, 1], 'both ranks take prompts');
  ph.proc.kill('SIGTERM');
  // ... and power_of_two weighs each rank by its own load (rank_loads), not the engine's.
  health = '{"status":"ok","load":8,"rank_loads":[0,8]}';
  const p2 = await router(['--worker', url, '--dp-aware', '--policy', 'power_of_two']);
  await until(async () => (await workers(p2.url)).filter((w) => w.load === 8).length === 1, 'the ranks\' loads read');
  const from2 = seen.length;
  for (let i = 0; i < 6; i++) assert.equal((await post(p2.url, '/v1/completions', { prompt: 'x', max_tokens: 1 })).status, 200);
  assert.deepEqual(seen.slice(from2), [0, 0, 0, 0, 0, 0], 'the idle rank takes them');
  p2.proc.kill('SIGTERM');
  health = '{"status":"ok","load":0}';
  // Without --dp-aware the engine is one worker and requests name no rank.
  const plain = await router(['--worker', url]);
  await until(async () => (await fetch(plain.url + '/health')).status === 200, 'router healthy');
  assert.equal((await post(plain.url, '/v1/completions', { prompt: 'x', max_tokens: 1 })).status, 200);
  assert.equal(seen.at(-1), undefined);
  assert.equal((await workers(plain.url)).length, 1);
  plain.proc.kill('SIGTERM');
  stub.close();
});

test('X-Request-Id: one id for every event of a PD stream, whatever the client sent', async () => {
  for (const [rid, want] of [['req-42', 'cmpl-req-42'], ['req:42', null], ['a'.repeat(70), null], [null, null]]) {
    const res = await fetch(R1.url + '/v1/completions', {
      method: 'POST', headers: { 'content-type': 'application/json', ...(rid ? { 'x-request-id': rid } : {}) },
      body: JSON.stringify({ prompt: prompts()[3], ...GEN, stream: true }),
    });
    const ids = new Set((await sse(res)).map((e) => e.id));
    assert.equal(ids.size, 1, `${rid}: ${[...ids]}`);
    if (want) assert.equal([...ids][0], want);
  }
});

test('the openai client streams chat and completions through the router', async () => {
  const client = new OpenAI({ baseURL: R1.url + '/v1', apiKey: 'none' });
  const models = await client.models.list();
  assert.equal(models.data.length, 1, 'the union of the workers\' models');
  const model = models.data[0].id;
  assert.equal((await client.models.retrieve(model)).id, model);
  await assert.rejects(client.models.retrieve('no-such-model'), (e) => e.status === 404);
  const p = prompts()[5];
  const stream = await client.completions.create({ model, prompt: p, ...GEN, stream: true });
  let text = '';
  for await (const chunk of stream) text += chunk.choices[0]?.text ?? '';
  assert.equal(text, await expected(p));
  const full = await client.completions.create({ model, prompt: p, ...GEN });
  assert.equal(full.choices[0].text, text);
});

test('the first token reaches a streaming client before the decode starts', async () => {
  // The router streams the prefill's token itself; the decode begins after it.
  const p = prompts()[6];
  const s = await fetch(R1.url + '/v1/completions', { method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt: p, ...GEN, stream: true }) });
  const ev = await sse(s);
  const texts = ev.map((e) => e.choices[0].text);
  assert.equal(texts.join(''), await expected(p));
  assert.equal(ev.length, 10, 'one event per token: the first token is not repeated');
});

test('PD streams what one engine answers: stop strings, unfinished characters, logprobs; too long is a 400', async () => {
  // The router streams the producer's first token before the decode starts: that text must
  // keep back what a stream keeps back (a possible stop string's start, a character whose
  // bytes are not all there), or the client sees it twice or sees text past a stop.
  const joined = async (base, body) => {
    const s = await fetch(base + '/v1/completions', { method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ ...body, stream: true }) });
    assert.equal(s.status, 200);
    return (await sse(s)).map((e) => (e.choices[0] ? e.choices[0].text : '')).join('');
  };
  const cases = [
    { prompt: [1, 306, 463], max_tokens: 4, temperature: 0, stop: 'inanX' }, // the first token starts the stop string
    { prompt: [1, 306, 463], max_tokens: 4, temperature: 0, stop: 'na' }, // the stop string spans tokens 1 and 2
    { prompt: [1, 306, 463], max_tokens: 1, temperature: 0, stop: 'inanX' }, // held back, then released at the end
  ];
  // Logit changes: the producer applies them to the first token, the decode to the rest.
  cases.push({ prompt: prompts()[4], max_tokens: 12, temperature: 0, ignore_eos: true, frequency_penalty: 1,
    presence_penalty: 0.5, repetition_penalty: 1.3, logit_bias: { 306: 2, 400: -5 } });
  for (let seed = 1; seed <= 12; seed++)
    cases.push({ prompt: prompts()[seed % 8], max_tokens: 12, temperature: 1.5, seed, stop: ['e', 'th'] });
  for (const body of cases) {
    const want = (await post(AGG.url, '/v1/completions', body)).json.choices[0].text;
    for (const r of [R1, RW]) {
      const full = await post(r.url, '/v1/completions', body);
      assert.equal(full.status, 200, full.text);
      assert.equal(full.json.choices[0].text, want, JSON.stringify(body));
      assert.equal(await joined(r.url, body), want, `streamed through ${r === R1 ? 'read' : 'write'} mode: ${JSON.stringify(body)}`);
    }
  }
  // The first token's log-probabilities are the producer's (read mode), streamed or not.
  const lb = { prompt: prompts()[3], max_tokens: 3, temperature: 0, logprobs: 2 };
  const want = (await post(AGG.url, '/v1/completions', lb)).json.choices[0].logprobs;
  assert.ok(want.token_logprobs[0] < 0 && Object.keys(want.top_logprobs[0]).length === 2);
  assert.deepEqual((await post(R1.url, '/v1/completions', lb)).json.choices[0].logprobs, want);
  const s = await fetch(R1.url + '/v1/completions', { method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...lb, stream: true }) });
  const ev = (await sse(s)).filter((e) => e.choices[0] && e.choices[0].logprobs);
  assert.deepEqual(ev.map((e) => e.choices[0].logprobs.token_logprobs[0]), want.token_logprobs);
  assert.deepEqual(ev.map((e) => e.choices[0].logprobs.top_logprobs[0]), want.top_logprobs);
  // A request the context cannot hold is refused before any event, with the client's numbers.
  for (const r of [R1, RW]) {
    const bad = await post(r.url, '/v1/completions', { prompt: [1, 306], max_tokens: 500, stream: true });
    assert.equal(bad.status, 400, bad.text);
    assert.equal(bad.json.error.param, 'max_tokens');
    assert.match(bad.json.error.message, /502 tokens \(2 in the prompt, 500 for the completion\)/);
  }
  await idle(P1.url, 'the producer');
  await idle(D1.url, 'the consumer');
});

test('bad requests get the engines\' error shapes; a wrong API key gets 401', async () => {
  for (const [body, param] of [['{"prompt": ', null], [{ prompt: 'x', max_tokens: -3 }, 'max_tokens'], [{ max_tokens: 3 }, 'prompt']]) {
    const viaRouter = await post(R1.url, '/v1/completions', body);
    const direct = await post(AGG.url, '/v1/completions', body);
    assert.equal(viaRouter.status, 400, viaRouter.text);
    assert.deepEqual(viaRouter.json, direct.json);
    if (param) assert.equal(viaRouter.json.error.param, param);
  }
  const rk = await router(['--worker', AGG.url, '--api-key', 'sekrit']);
  // (its worker counts once it has answered the router: until then requests get a 503)
  await until(async () => (await fetch(rk.url + '/health')).status === 200, 'the keyed router healthy');
  let r = await post(rk.url, '/v1/completions', { prompt: 'x', max_tokens: 2 });
  assert.equal(r.status, 401);
  assert.equal(r.json.error.code, 'invalid_api_key');
  r = await post(rk.url, '/v1/completions', { prompt: 'x', max_tokens: 2 }, { authorization: 'Bearer wrong' });
  assert.equal(r.status, 401);
  r = await post(rk.url, '/v1/completions', { prompt: [1, 5, 6], max_tokens: 2 }, { authorization: 'Bearer sekrit' });
  assert.equal(r.status, 200, r.text);
  assert.equal((await fetch(rk.url + '/health')).status, 200);
  // /workers is guarded too; an engine registers with TANDEM_ROUTER_API_KEY.
  assert.equal((await fetch(rk.url + '/workers')).status, 401);
  // The counters count completion requests, the refused ones too: never more responses
  // than requests (the 401 of /workers is not a completion request).
  const km = await metrics(rk.url);
  assert.equal(km.tandem_router_requests_total, 3);
  assert.equal(km['tandem_router_responses_total{class="4xx"}'], 2);
  assert.equal(km['tandem_router_responses_total{class="2xx"}'], 1);
  const eng = await start(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1', '--server-port', '0',
    '--log-level', 'warn', '--kv-transfer-config', JSON.stringify({ kv_role: 'kv_consumer', proxy_ip: '127.0.0.1', proxy_ping_port: rk.port })],
  { TANDEM_ROUTER_API_KEY: 'sekrit' });
  await until(async () => {
    const ws = await (await fetch(rk.url + '/workers', { headers: { authorization: 'Bearer sekrit' } })).json();
    return ws.workers.some((w) => w.url === eng.url);
  }, 'the engine registered with the key');
  eng.proc.kill('SIGKILL');
  r = await fetch(R1.url + '/nope');
  assert.equal(r.status, 404);
  // Methods a route does not take are a JSON 405, as at the engines; HEAD is a GET's
  // headers.
  for (const method of ['OPTIONS', 'PUT', 'PATCH', 'DELETE']) {
    r = await fetch(R1.url + '/v1/completions', { method });
    assert.equal(r.status, 405, method);
    assert.equal((await r.json()).error.type, 'invalid_request_error');
  }
  r = await fetch(R1.url + '/health', { method: 'HEAD' });
  assert.equal(r.status, 200);
  assert.equal(await r.text(), '');
  // A body past --max-payload-size (4 MiB) is the router's own 413, never forwarded.
  const rawStatus = (port, request) => new Promise((resolve, reject) => {
    const c = net.connect(port, '127.0.0.1', () => c.write(request));
    let got = '';
    c.on('data', (d) => { got += d; });
    c.on('close', () => resolve(got.split('\r\n')[0]));
    c.on('error', reject);
  });
  const badJson = 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\n{';
  assert.equal(await rawStatus(R1.port, badJson), 'HTTP/1.1 400 Bad Request', 'a reason phrase in the status line');
  const before = (await metrics(R1.url))['tandem_router_responses_total{class="4xx"}'] ?? 0;
  r = await post(R1.url, '/v1/completions', { prompt: 'a'.repeat(5_000_000), max_tokens: 1 });
  assert.equal(r.status, 413, r.text);
  assert.match(r.json.error.message, /50000\d\d bytes; the limit is 4194304 \(--max-payload-size\)/);
  assert.equal((await metrics(R1.url))['tandem_router_responses_total{class="4xx"}'], before + 1, 'the 413 counted');
  // A worker URL whose host is no host name (it would land in the metrics' labels) is refused.
  r = await post(R1.url, '/workers', { url: 'http://x\ninjected 42\n:81', role: 'worker' });
  assert.equal(r.status, 400, r.text);
  // Headers past 64 KiB are a 400, as at the engines (a raw request: clients cap them).
  const status = await new Promise((resolve, reject) => {
    const c = net.connect(R1.port, '127.0.0.1', () =>
      c.write(`GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(200000)}\r\n\r\n`));
    let got = '';
    c.on('data', (d) => { got += d; });
    c.on('close', () => resolve(got.split('\r\n')[0]));
    c.on('error', reject);
  });
  assert.match(status, /^HTTP\/1\.1 400/, status);
  rk.proc.kill('SIGTERM');
});

test('admission: past --max-concurrent-requests requests queue; a full queue is 429, a long wait 408', async () => {
  const slow = await serve(null, ['--enable-debug-endpoints', '--debug-step-delay-ms', '50']);
  const r = await router(['--worker', slow.url, '--max-concurrent-requests', '1', '--queue-size', '1',
    '--queue-timeout-secs', '0.3']);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  const body = { prompt: [1, 5, 6], max_tokens: 20, temperature: 0, ignore_eos: true };
  const first = post(r.url, '/v1/completions', body); /* ~1 s: 20 steps of 50 ms */
  await until(async () => (await metrics(r.url)).tandem_router_requests_running === 1, 'the first request running');
  const second = post(r.url, '/v1/completions', body); /* queued, then too long */
  await until(async () => (await metrics(r.url)).tandem_router_queue_depth === 1, 'the second request queued');
  const third = await post(r.url, '/v1/completions', body); /* the queue is full */
  assert.equal(third.status, 429, third.text);
  assert.equal((await second).status, 408);
  assert.equal((await first).status, 200);
  const m = await metrics(r.url);
  assert.equal(m.tandem_router_rejected_total, 1);
  assert.equal(m.tandem_router_queue_timeouts_total, 1);
  // A queued request that cannot start when its turn comes (its only worker was removed
  // meanwhile) is answered at once and gives its slot back: the next one runs.
  const r2 = await router(['--worker', slow.url, '--max-concurrent-requests', '1', '--queue-timeout-secs', '5']);
  await until(async () => (await fetch(r2.url + '/health')).status === 200, 'router healthy');
  const a = post(r2.url, '/v1/completions', body);
  await until(async () => (await metrics(r2.url)).tandem_router_requests_running === 1, 'the first request running');
  const b = post(r2.url, '/v1/completions', body);
  await until(async () => (await metrics(r2.url)).tandem_router_queue_depth === 1, 'the second request queued');
  const wid = (await workers(r2.url))[0].id;
  assert.equal((await fetch(`${r2.url}/workers/${wid}`, { method: 'DELETE' })).status, 200);
  assert.equal((await a).status, 200);
  assert.equal((await b).status, 503);
  assert.equal((await post(r2.url, '/workers', { url: slow.url, role: 'worker' })).status, 201);
  await until(async () => (await fetch(r2.url + '/health')).status === 200, 'the worker back');
  assert.equal((await metrics(r2.url)).tandem_router_requests_running, 0, 'no slot held by the 503');
  const c = await post(r2.url, '/v1/completions', { ...body, max_tokens: 2 });
  assert.equal(c.status, 200, c.text);
  for (const x of [r, r2, slow]) x.proc.kill('SIGKILL');
});

test('a client that hangs up while the prefill\'s answer is on its way: the router gives that KV back', async () => {
  // The router is stopped (SIGSTOP) once the prefill runs; the client hangs up, then the
  // prefill answers into the router's socket. When the router runs again both have
  // happened: it must read the answer, which alone names the leased KV, and release it,
  // not drop it and leave the lease (60 s here) to expire.
  const prod = await serve({ kv_role: 'kv_producer', lease_ms: 60000 }, ['--enable-debug-endpoints', '--debug-step-delay-ms', '300']);
  const r = await router(['--pd-disaggregation', '--prefill', prod.url, '--decode', D1.url]);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  const before = await metrics(prod.url);
  const u = new URL(r.url);
  const req = http.request({ host: u.hostname, port: u.port, path: '/v1/completions', method: 'POST',
    headers: { 'content-type': 'application/json' } });
  req.on('error', () => {});
  req.end(JSON.stringify({ prompt: prompts()[4], ...GEN }));
  await until(async () => (await metrics(r.url)).tandem_router_requests_running === 1, 'the request at the router');
  await new Promise((ok) => setTimeout(ok, 100)); /* its prefill leg sent: the step takes 300 ms */
  r.proc.kill('SIGSTOP');
  try {
    // The client's hang-up first, then the answer: the router sees them in that order.
    req.destroy();
    await until(async () => (await metrics(prod.url)).tandem_kv_leases_total === before.tandem_kv_leases_total + 1,
      'the prefill answered');
  } finally {
    r.proc.kill('SIGCONT');
  }
  await until(async () => (await metrics(prod.url)).tandem_kv_leases_active === 0, 'the lease given back', 10000);
  const m = await metrics(prod.url);
  assert.equal(m.tandem_kv_leases_expired_total, 0);
  await idle(prod.url, 'the producer');
  await idle(D1.url, 'the decode');
  for (const x of [r, prod]) x.proc.kill('SIGKILL');
});

test('a client that hangs up mid-stream: both engines free their blocks', async () => {
  // A decode slowed down (20 ms a step) so that the stream is surely still running.
  const slow = await serve({ kv_role: 'kv_consumer' }, ['--enable-debug-endpoints', '--debug-step-delay-ms', '20']);
  const r = await router(['--pd-disaggregation', '--prefill', P1.url, '--decode', slow.url]);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  const p = prompts()[1];
  await new Promise((resolve) => {
    const u = new URL(r.url);
    const req = http.request({ host: u.hostname, port: u.port, path: '/v1/completions', method: 'POST',
      headers: { 'content-type': 'application/json' } }, (res) => {
      res.once('data', () => { req.destroy(); resolve(); });
    });
    req.on('error', () => resolve());
    req.end(JSON.stringify({ prompt: p, max_tokens: 100, temperature: 0, ignore_eos: true, stream: true }));
  });
  await until(async () => (await metrics(r.url)).tandem_router_client_disconnects_total >= 1, 'the router saw the hang-up');
  await idle(P1.url, 'prefill');
  await idle(slow.url, 'decode');
  // The decode's request was aborted, not run to its end for nobody.
  const text = await (await fetch(slow.url + '/metrics')).text();
  const aborted = text.match(/tandem_request_success_total\{[^}]*finished_reason="abort"\} (\d+)/);
  assert.ok(aborted && Number(aborted[1]) >= 1, 'the decode aborted the request');
  await until(async () => (await metrics(r.url)).tandem_router_requests_running === 0, 'router idle');
  for (const x of [r, slow]) x.proc.kill('SIGKILL');
});

test('a hung prefill (SIGSTOP) is a 504 within the timeout, never a hang', async () => {
  const p = await serve({ kv_role: 'kv_producer' });
  const r = await router(['--pd-disaggregation', '--prefill', p.url, '--decode', D2.url, '--request-timeout-secs', '1.5',
    '--retry-max-retries', '0']);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  p.proc.kill('SIGSTOP');
  const t0 = Date.now();
  const res = await post(r.url, '/v1/completions', { prompt: prompts()[2], ...GEN });
  assert.equal(res.status, 504, res.text);
  assert.equal(res.json.error.type, 'gateway_timeout');
  assert.ok(Date.now() - t0 < 10000);
  p.proc.kill('SIGCONT');
  p.proc.kill('SIGKILL');
  r.proc.kill('SIGTERM');
});

test('a prefill killed: the other one takes over; the dead one leaves the pairing', async () => {
  const [pa, pb] = await Promise.all([serve({ kv_role: 'kv_producer' }), serve({ kv_role: 'kv_producer' })]);
  const r = await router(['--pd-disaggregation', '--prefill', pa.url, '--prefill', pb.url, '--decode', D1.url,
    '--policy', 'round_robin', '--cb-failure-threshold', '1', '--cb-timeout-duration-secs', '60']);
  // Both prefills in service first: the router is healthy with one, and a prefill it has
  // not heard from yet would never be sent a request, so its breaker could not open.
  await until(async () => (await workers(r.url)).every((w) => w.ready), 'every worker ready');
  pa.proc.kill('SIGKILL');
  const ps = prompts(8);
  for (const p of ps) {
    const res = await post(r.url, '/v1/completions', { prompt: p, ...GEN });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.choices[0].text, await expected(p));
  }
  const dead = (await workers(r.url)).find((w) => w.url === pa.url);
  assert.equal(dead.circuit_breaker, 'open');
  assert.ok((await metrics(r.url)).tandem_router_retries_total >= 1);
  await until(async () => (await workers(r.url)).find((w) => w.url === pa.url).healthy === false, 'the dead prefill marked unhealthy');
  pb.proc.kill('SIGKILL');
  // No prefill left: a clear 503, at once.
  await until(async () => (await fetch(r.url + '/health')).status === 503, 'router unhealthy');
  const res = await post(r.url, '/v1/completions', { prompt: ps[0], ...GEN });
  assert.equal(res.status, 503, res.text);
  assert.match(res.json.error.message, /prefill/);
  r.proc.kill('SIGTERM');
});

test('the only decode killed: a clear 5xx, not a hang, and the prefill\'s KV comes back at once', async () => {
  // A lease far longer than the test: only the router's POST /kv_release can free it in time.
  const [p, d] = await Promise.all([serve({ kv_role: 'kv_producer', lease_ms: 600000 }), serve({ kv_role: 'kv_consumer' })]);
  const r = await router(['--pd-disaggregation', '--prefill', p.url, '--decode', d.url, '--retry-max-retries', '1']);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  d.proc.kill('SIGKILL');
  const res = await post(r.url, '/v1/completions', { prompt: prompts()[4], ...GEN });
  assert.ok(res.status === 502 || res.status === 503, res.text);
  assert.match(res.json.error.message, /decode/);
  // The prefill's KV, which no decode read, comes back when the router gives it up.
  await idle(p.url, 'the prefill whose KV nobody read');
  const rm = await metrics(r.url);
  assert.equal(rm.tandem_router_kv_releases_total, 1);
  for (const x of [r, p]) x.proc.kill('SIGKILL');
});

test('workers register themselves, are removed, restarted and evicted, with no router restart', async () => {
  const r = await router(['--pd-disaggregation', '--worker-ttl-secs', '2']);
  assert.equal((await fetch(r.url + '/health')).status, 503);
  // Engines that name the router in their kv-transfer config register and heartbeat.
  const reg = { proxy_ip: '127.0.0.1', proxy_ping_port: r.port };
  const d = await serve({ kv_role: 'kv_consumer', ...reg });
  // The prefill is restarted on its port below: a port outside the ephemeral range, so that no
  // outgoing connection can take it in between.
  const prefillOn = (port) => start(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1',
    '--server-port', String(port), '--log-level', 'warn', '--kv-transfer-config', JSON.stringify({ kv_role: 'kv_producer', ...reg })]);
  const port = await freePort();
  let p = await prefillOn(port);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy with registered workers');
  const q = prompts()[3];
  let res = await post(r.url, '/v1/completions', { prompt: q, ...GEN });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.json.choices[0].text, await expected(q));
  // A worker whose kv_role does not match the role it is registered in is refused.
  const extra = await serve({ kv_role: 'kv_consumer' });
  res = await post(r.url, '/workers', { url: extra.url, role: 'prefill' });
  assert.equal(res.status, 201, res.text);
  await until(async () => {
    const w = (await workers(r.url)).find((x) => x.url === extra.url);
    return w && w.kv_role === 'kv_consumer' && w.ready === false;
  }, 'the mismatched worker refused');
  const id = (await workers(r.url)).find((x) => x.url === extra.url).id;
  assert.equal((await fetch(`${r.url}/workers/${id}`, { method: 'DELETE' })).status, 200);
  assert.equal((await fetch(`${r.url}/workers/${id}`, { method: 'DELETE' })).status, 404);
  extra.proc.kill('SIGKILL');
  // Restart the prefill on the same port: a new engine id replaces the stale entry.
  const oldId = (await workers(r.url)).find((x) => x.role === 'prefill').engine_id;
  const gone = new Promise((ok) => p.proc.on('exit', ok));
  p.proc.kill('SIGKILL');
  await gone;
  p = await prefillOn(port);
  await until(async () => {
    const w = (await workers(r.url)).find((x) => x.role === 'prefill');
    return w && w.engine_id && w.engine_id !== oldId && w.ready;
  }, 'the restarted prefill known by its new engine id');
  res = await post(r.url, '/v1/completions', { prompt: q, ...GEN });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.json.choices[0].text, await expected(q));
  assert.equal((await workers(r.url)).filter((x) => x.role === 'prefill').length, 1);
  // A worker that stops its heartbeats (killed) is evicted.
  d.proc.kill('SIGKILL');
  await until(async () => !(await workers(r.url)).find((x) => x.role === 'decode'), 'the dead decode evicted');
  assert.ok((await metrics(r.url)).tandem_router_worker_evictions_total >= 1);
  assert.equal((await fetch(r.url + '/health')).status, 503);
  for (const x of [r, p]) x.proc.kill('SIGKILL');
});

test('a decode restarted at its URL takes requests at once: its old incarnation\'s open breaker is forgotten', async () => {
  // One failure opens a breaker for a minute. The decode (a consumer: no engine id of its
  // own) is killed, a request trips its breaker, and a new process on the same port must be
  // used as soon as it registers or its health check sees the new instance.
  const r = await router(['--pd-disaggregation', '--cb-failure-threshold', '1', '--cb-timeout-duration-secs', '60',
    '--retry-max-retries', '0', '--prefill', P1.url]);
  const reg = { proxy_ip: '127.0.0.1', proxy_ping_port: r.port };
  const port = await freePort();
  const decodeOn = () => start(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1',
    '--server-port', String(port), '--log-level', 'warn', '--kv-transfer-config', JSON.stringify({ kv_role: 'kv_consumer', ...reg })]);
  let d = await decodeOn();
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  const q = prompts()[4];
  assert.equal((await post(r.url, '/v1/completions', { prompt: q, ...GEN })).status, 200);
  const gone = new Promise((ok) => d.proc.on('exit', ok));
  d.proc.kill('SIGKILL');
  await gone;
  const failed = await post(r.url, '/v1/completions', { prompt: q, ...GEN });
  assert.ok(failed.status >= 500, `${failed.status} ${failed.text}`);
  await until(async () => (await workers(r.url)).find((x) => x.role === 'decode')?.circuit_breaker === 'open',
    'the dead decode\'s breaker open');
  d = await decodeOn();
  await until(async () => (await post(r.url, '/v1/completions', { prompt: q, ...GEN })).status === 200,
    'a request served by the restarted decode', 10000);
  const w = (await workers(r.url)).find((x) => x.role === 'decode');
  assert.equal(w.circuit_breaker, 'closed', JSON.stringify(w));
  for (const x of [r, d]) x.proc.kill('SIGKILL');
});

test('a prefill given on the command line and restarted at its URL is known by its new agent, not the stale one', async () => {
  // Not registered (no proxy in its config), so only the health checks can see the restart:
  // its /health carries an instance id, and a new one makes the router read
  // /kv_transfer_info again (the new agent's port and engine id).
  const pp = await freePort();
  const prefillOn = () => start(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1',
    '--server-port', String(pp), '--log-level', 'warn', '--kv-transfer-config', JSON.stringify({ kv_role: 'kv_producer' })]);
  let p = await prefillOn();
  const r = await router(['--pd-disaggregation', '--prefill', `http://127.0.0.1:${pp}`, '--decode', D1.url]);
  const pre = async () => (await workers(r.url)).find((x) => x.role === 'prefill');
  await until(async () => { const w = await pre(); return w && w.ready && w.engine_id; }, 'the prefill read');
  const first = await pre();
  const gone = new Promise((ok) => p.proc.on('exit', ok));
  p.proc.kill('SIGKILL');
  await gone;
  p = await prefillOn();
  await until(async () => { const w = await pre(); return w && w.ready && w.engine_id && w.engine_id !== first.engine_id; },
    'the restarted prefill read again', 10000);
  const q = prompts()[5];
  const res = await post(r.url, '/v1/completions', { prompt: q, ...GEN });
  assert.equal(res.status, 200, res.text);
  assert.equal(res.json.choices[0].text, await expected(q));
  for (const x of [r, p]) x.proc.kill('SIGTERM');
});

test('a router started before its engines serves as soon as they are up, not at the next health check', async () => {
  const [pp, dp] = [await freePort(), await freePort()];
  // health checks (and so the old way back in) once an hour: only discovery can find them
  const late = await start(['router', '--host', '127.0.0.1', '--port', '0', '--log-level', 'warn',
    '--health-check-interval-secs', '3600', '--worker-ttl-secs', '36000', '--pd-disaggregation',
    '--prefill', `http://127.0.0.1:${pp}`, '--decode', `http://127.0.0.1:${dp}`]);
  await until(async () => (await workers(late.url)).every((w) => !w.ready), 'the first probes fail');
  const r0 = await post(late.url, '/v1/completions', { prompt: [1, 306], ...GEN });
  assert.ok(r0.status >= 500, `no engine yet: ${r0.status} ${r0.text}`);
  await new Promise((r) => setTimeout(r, 1500)); // a few failed probes: the gap has grown
  const [lp, ld] = await Promise.all([
    start(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1', '--server-port', String(pp),
      '--log-level', 'warn', '--kv-transfer-config', JSON.stringify({ kv_role: 'kv_producer' })]),
    start(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1', '--server-port', String(dp),
      '--log-level', 'warn', '--kv-transfer-config', JSON.stringify({ kv_role: 'kv_consumer' })]),
  ]);
  await until(async () => (await workers(late.url)).every((w) => w.ready), 'the late engines discovered', 15000);
  const r = await post(late.url, '/v1/completions', { prompt: [1, 306], ...GEN });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.choices[0].text, await expected([1, 306]));
  for (const p of [late, lp, ld]) p.proc.kill('SIGTERM');
});

test('a plain worker counts only once it has answered: until then /health is 503 and requests do not trip its breaker', async () => {
  const wp = await freePort();
  const late = await start(['router', '--host', '127.0.0.1', '--port', '0', '--log-level', 'warn',
    '--health-check-interval-secs', '3600', '--worker', `http://127.0.0.1:${wp}`]);
  // Nothing listens there yet: the router must not call itself healthy (`tandem up` waits
  // on this), and requests are refused at once, without counting against the worker.
  const h = await fetch(late.url + '/health');
  assert.equal(h.status, 503, await h.text());
  assert.equal((await workers(late.url))[0].reachable, false);
  for (let i = 0; i < 8; i++) {
    const r0 = await post(late.url, '/v1/completions', { prompt: [1, 306], ...GEN });
    assert.equal(r0.status, 503, r0.text);
  }
  assert.equal((await workers(late.url))[0].circuit_breaker, 'closed');
  const eng = await start(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1', '--server-port', String(wp),
    '--log-level', 'warn']);
  await until(async () => (await fetch(late.url + '/health')).status === 200, 'the late worker discovered', 15000);
  const w = (await workers(late.url))[0];
  assert.equal(w.reachable, true);
  const models = await (await fetch(late.url + '/v1/models')).json();
  assert.equal(models.data.length, 1, 'the model is known by the time the router is healthy');
  const r = await post(late.url, '/v1/completions', { prompt: [1, 306], ...GEN });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.choices[0].text, await expected([1, 306]));
  for (const p of [late, eng]) p.proc.kill('SIGTERM');
});

test('out of descriptors, the router and an engine pause accepting, keep their state, and serve again', async () => {
  // Both with 64 descriptors at most; 100 idle connections to one of them use up its table,
  // so accept() fails (and the router's own health checks fail before they are sent).
  const lim = (args) => startTandem('bash', ['-c', 'ulimit -n 64 && exec "$0" "$@"', BIN, ...args], procs);
  const eng = await lim(['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1', '--server-port', '0',
    '--log-level', 'warn']);
  const r = await lim(['router', '--host', '127.0.0.1', '--port', '0', '--log-level', 'warn',
    '--health-check-interval-secs', '0.1', '--worker', eng.url]);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'the router healthy');
  const want = await expected([1, 306]);
  for (const target of [r, eng]) {
    const socks = [];
    for (let i = 0; i < 100; i++) {
      const c = net.connect(target.port, '127.0.0.1');
      c.on('error', () => {});
      socks.push(c);
    }
    await new Promise((ok) => setTimeout(ok, 1000));
    for (const c of socks) c.destroy();
    let res;
    await until(async () => {
      try { res = await post(target.url, '/v1/completions', { prompt: [1, 306], ...GEN }); } catch { return false; }
      return res.status === 200;
    }, 'serving again', 15000);
    assert.equal(res.json.choices[0].text, want);
    // One warning for the episode, not one per failed accept() (libevent's default).
    const lines = target.stderr().split('\n');
    const warns = lines.filter((l) => l.includes('cannot accept connections')).length;
    assert.ok(warns >= 1 && warns <= 2, `${warns} warnings: ${lines.slice(-5).join(' | ')}`);
    assert.ok(!target.stderr().includes('Error from accept()'), 'no per-call warnings');
  }
  for (const p of [r, eng]) {
    const code = await new Promise((ok) => { p.proc.on('exit', (c) => ok(c)); p.proc.kill('SIGTERM'); });
    assert.equal(code, 0, p.stderr().slice(-2000));
  }
});

test('an engine out of descriptors while its router restarts registers again once both are back', async () => {
  // The router on a fixed port, so that a new one can take over at the same address.
  const port = await freePort();
  const routerOn = () => start(['router', '--host', '127.0.0.1', '--port', String(port), '--log-level', 'warn',
    '--pd-disaggregation', '--health-check-interval-secs', '0.2']);
  let r = await routerOn();
  const d = await serve({ kv_role: 'kv_consumer', proxy_ip: '127.0.0.1', proxy_ping_port: port });
  const registered = async () => (await workers(r.url)).some((w) => w.url === d.url);
  await until(registered, 'the decode engine registered');
  // No descriptor left for the engine (a limit of 3: every new socket fails with EMFILE),
  // then the router goes away: the engine's next heartbeat needs a new connection and
  // fails inside evhttp_make_request, which answers it before returning.
  const pid = String(d.proc.pid);
  const [soft, hard] = execFileSync('prlimit', ['--pid', pid, '--nofile', '--raw', '--noheadings',
    '--output=SOFT,HARD']).toString().trim().split(/\s+/);
  execFileSync('prlimit', ['--pid', pid, '--nofile=3:' + hard]);
  await new Promise((ok) => { r.proc.on('exit', ok); r.proc.kill('SIGKILL'); });
  await until(async () => d.stderr().includes('cannot register with the router'), 'a heartbeat failed', 15000);
  // Descriptors back and a router at the same address: the heartbeats go on (a registrar
  // left waiting for that failed request's answer would never send another).
  execFileSync('prlimit', ['--pid', pid, `--nofile=${soft}:${hard}`]);
  r = await routerOn();
  await until(registered, 'the decode engine registered again', 20000);
  for (const p of [r, d]) p.proc.kill('SIGKILL');
});

test('a router out of descriptors fails the requests it cannot send without blaming the worker', async () => {
  // One failure would open the breaker for a minute; health checks stay out of the way.
  const e = await serve(null);
  const r = await router(['--worker', e.url, '--cb-failure-threshold', '1', '--cb-timeout-duration-secs', '60',
    '--health-check-interval-secs', '60', '--retry-max-retries', '1']);
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'the router healthy');
  // Four client connections, accepted while the router still had descriptors.
  const socks = await Promise.all([0, 1, 2, 3].map(() => new Promise((ok, bad) => {
    const c = net.connect(r.port, '127.0.0.1', () => ok(c));
    c.on('error', bad);
  })));
  await new Promise((ok) => setTimeout(ok, 500));
  const pid = String(r.proc.pid);
  const [soft, hard] = execFileSync('prlimit', ['--pid', pid, '--nofile', '--raw', '--noheadings',
    '--output=SOFT,HARD']).toString().trim().split(/\s+/);
  execFileSync('prlimit', ['--pid', pid, '--nofile=3:' + hard]);
  // Four at once: at most one finds an idle pooled connection to the engine; the others
  // need a new socket, which fails inside evhttp_make_request.
  const body = JSON.stringify({ prompt: [1, 306], ...GEN });
  const answers = await Promise.all(socks.map((c) => new Promise((ok) => {
    let text = '';
    c.on('data', (d) => { text += d; });
    c.on('close', () => ok(text));
    c.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n` +
      `Connection: close\r\nContent-Length: ${body.length}\r\n\r\n${body}`);
  })));
  execFileSync('prlimit', ['--pid', pid, `--nofile=${soft}:${hard}`]);
  const refused = answers.filter((a) => /^HTTP\/1\.1 5\d\d/.test(a) && a.includes('cannot send the request'));
  assert.ok(refused.length >= 1, `no request failed for want of a descriptor: ${answers.map((a) => a.slice(0, 60))}`);
  // Not the engine's fault: its breaker is closed and the next request is served.
  const w = (await workers(r.url)).find((x) => x.url === e.url);
  assert.equal(w.circuit_breaker, 'closed');
  const res = await post(r.url, '/v1/completions', { prompt: [1, 306], ...GEN });
  assert.equal(res.status, 200, res.text);
  const direct = await post(e.url, '/v1/completions', { prompt: [1, 306], ...GEN });
  assert.equal(res.json.choices[0].text, direct.json.choices[0].text);
  for (const p of [r, e]) p.proc.kill('SIGKILL');
});

test('every engine is idle at the end, and the routers shut down cleanly', async () => {
  for (const e of [P1, P2, D1, D2, PW]) await idle(e.url, e.url);
  for (const r of [R1, R2, RA, RW]) {
    const code = await new Promise((ok) => { r.proc.on('exit', (c) => ok(c)); r.proc.kill('SIGTERM'); });
    assert.equal(code, 0, r.stderr());
  }
});
