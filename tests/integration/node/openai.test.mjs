// `tandem serve` driven by the official `openai` npm client, unchanged: completions,
// chat, and streaming with both. Started by tests/integration/test_serve_openai.sh
// with TD_URL and TD_MODEL_NAME.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const client = new OpenAI({ baseURL: process.env.TD_URL + '/v1', apiKey: 'unused', maxRetries: 0 });
const model = process.env.TD_MODEL_NAME;

test('openai: models.list and models.retrieve', async () => {
  const page = await client.models.list();
  assert.equal(page.data[0].id, model);
  const m = await client.models.retrieve(model);
  assert.equal(m.id, model);
  assert.equal(m.object, 'model');
  await assert.rejects(client.models.retrieve('no-such-model'), (e) => e.status === 404 && /does not exist/.test(e.message));
});

test('openai: completions.create, plain and streamed', async () => {
  const body = { model, prompt: 'Once upon a time', max_tokens: 12, temperature: 0 };
  const r = await client.completions.create(body);
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices.length, 1);
  assert.ok(r.usage.completion_tokens > 0);
  let text = '';
  let finish = null;
  let usage = null;
  const stream = await client.completions.create({ ...body, stream: true,
    stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, r.choices[0].text);
  assert.equal(finish, r.choices[0].finish_reason);
  assert.equal(usage.completion_tokens, r.usage.completion_tokens);
});

test('openai: token-id prompts and batches', async () => {
  const r = await client.completions.create({ model, prompt: [[1, 306, 463], [1, 400]],
    max_tokens: 5, temperature: 0 });
  assert.equal(r.choices.length, 2);
});

test('openai: chat.completions.create, plain and streamed', async () => {
  const body = { model, messages: [{ role: 'system', content: 'You are terse.' },
    { role: 'user', content: 'Say something.' }], max_tokens: 10, temperature: 0 };
  const r = await client.chat.completions.create(body);
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  let text = '';
  let role = null;
  let finish = null;
  const stream = await client.chat.completions.create({ ...body, stream: true });
  for await (const chunk of stream) {
    const c = chunk.choices[0];
    if (!c) continue;
    if (c.delta.role) role = c.delta.role;
    text += c.delta.content ?? '';
    if (c.finish_reason) finish = c.finish_reason;
  }
  assert.equal(role, 'assistant');
  assert.equal(text, r.choices[0].message.content);
  assert.equal(finish, r.choices[0].finish_reason);
});

test('openai: a bad request surfaces as BadRequestError with the server message', async () => {
  await assert.rejects(
    client.completions.create({ model, prompt: [1, 2], max_tokens: -3 }),
    (e) => e.status === 400 && /max_tokens/.test(e.message));
});
