// A Node.js gRPC client of Coalesce, built only from the .proto files (@grpc/grpc-js + @grpc/proto-loader),
// as a user in another language would write it. It runs every RPC and the error cases against a server
// and prints one JSON object of what it saw; tests/e2e/test_node_client.py asserts on it.
//
//   node tests/e2e/node_client.js ADDRESS PROTO_ROOT GOOGLEAPIS_ROOT
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const [address, protoRoot, googleRoot] = process.argv.slice(2);
const LONG = 2000; // tokens: seconds of work for the built-in model

const definition = protoLoader.loadSync("coalesce/v1/inference.proto", {
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [protoRoot],
});
const coalesce = grpc.loadPackageDefinition(definition).coalesce.v1;
// The bearer token on every call, as an interceptor (grpc-js does not compose call credentials with an
// insecure channel).
const token = process.env.COALESCE_TOKEN;
const withToken = (options, nextCall) =>
  new grpc.InterceptingCall(nextCall(options), {
    start(metadata, listener, next) {
      if (token) metadata.set("authorization", `Bearer ${token}`);
      next(metadata, listener);
    },
  });
const client = new coalesce.InferenceService(address, grpc.credentials.createInsecure(), { interceptors: [withToken] });

// google.rpc.Status and its details, to read `grpc-status-details-bin` and SessionError.details.
const rpcTypes = new protobuf.Root();
rpcTypes.resolvePath = (_origin, target) => path.join(googleRoot, target);
rpcTypes.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"]);
const Status = rpcTypes.lookupType("google.rpc.Status");

function unpack(anys) {
  const out = { violations: [], reason: "", retry_delay_s: null };
  for (const any of anys) {
    const type = rpcTypes.lookupType(any.type_url.split("/").pop());
    const detail = type.toObject(type.decode(any.value), { longs: Number });
    if (type.name === "BadRequest") {
      out.violations.push(...(detail.fieldViolations || []).map((v) => [v.field, v.description]));
    } else if (type.name === "ErrorInfo") {
      out.reason = detail.reason;
    } else if (type.name === "RetryInfo") {
      out.retry_delay_s = Number(detail.retryDelay.seconds || 0) + (detail.retryDelay.nanos || 0) / 1e9;
    }
  }
  return out;
}

function failure(err) {
  const raw = err.metadata && err.metadata.get("grpc-status-details-bin")[0];
  const details = raw ? Status.decode(raw).details.map((d) => ({ type_url: d.type_url || d.typeUrl, value: d.value })) : [];
  return { code: grpc.status[err.code], message: err.details, ...unpack(details) };
}

function unary(method, request, options = {}) {
  return new Promise((resolve, reject) => client[method](request, options, (err, res) => (err ? reject(err) : resolve(res))));
}

// Every chunk of a server stream, or the error that ended it (with the chunks before it).
function stream(call) {
  return new Promise((resolve) => {
    const chunks = [];
    call.on("data", (msg) => chunks.push(msg.chunk || msg));
    call.on("error", (err) => resolve({ chunks, error: failure(err) }));
    call.on("end", () => resolve({ chunks, error: null }));
  });
}

const tokens = (chunks) => chunks.flatMap((c) => c.token_ids);
const request = (text, max_tokens, extra = {}) => ({
  text,
  stream: true,
  ...extra,
  sampling: { max_tokens, ignore_eos: true, ...(extra.sampling || {}) },
});
let ids = 0;
const newId = () => `node-${process.pid}-${++ids}`;

async function generate() {
  const { chunks, error } = await stream(client.Generate(request("hello from node", 8)));
  const last = chunks[chunks.length - 1];
  return {
    error,
    offsets: chunks.map((c) => c.offset),
    sizes: chunks.map((c) => c.token_ids.length),
    tokens: tokens(chunks),
    finish_reason: last.finish_reason,
    usage: last.usage,
    dedup_outcome: chunks[0].dedup_outcome,
    logprobs: chunks.flatMap((c) => c.logprobs).length,
  };
}

async function session() {
  // Five generations interleaved on one stream (compared with the same requests one at a time), a long one
  // that a duplicate stream_id does not disturb and a cancel ends, and misuse.
  const call = client.Session();
  const byStream = {};
  const done = new Promise((resolve) => {
    call.on("data", (msg) => (byStream[msg.stream_id] ||= []).push(msg));
    call.on("end", resolve);
    call.on("error", resolve);
  });
  call.write({ stream_id: "long", generate: { request: request("long on a session", LONG) } });
  for (let i = 0; i < 5; i++) {
    call.write({ stream_id: `g${i}`, generate: { request: request(`session ${i}`, 6 + i) } });
  }
  call.write({ stream_id: "long", generate: { request: request("duplicate", 3) } }); // "long" runs: refused
  call.write({ stream_id: "long", cancel: {} });
  call.write({ stream_id: "bad", generate: { request: request("bad", 3, { sampling: { top_k: -1 } }) } });
  call.write({ stream_id: "nobody", cancel: {} });
  call.write({ stream_id: "", generate: { request: request("no id", 3) } });
  call.end();
  await done;
  const alone = [];
  for (let i = 0; i < 5; i++) {
    alone.push(tokens((await stream(client.Generate(request(`session ${i}`, 6 + i)))).chunks));
  }
  const sessionError = (msgs) => {
    const e = (msgs || []).find((m) => m.event === "error");
    return e && { code: e.error.code, reason: e.error.reason, message: e.error.message,
                  continues: e.error.generation_continues, ...unpack(e.error.details) };
  };
  const generations = [0, 1, 2, 3, 4].map((i) => {
    const chunks = byStream[`g${i}`].filter((m) => m.event === "chunk").map((m) => m.chunk);
    return { tokens: tokens(chunks), finish_reason: chunks[chunks.length - 1].finish_reason };
  });
  const long = byStream.long.filter((m) => m.event === "chunk").map((m) => m.chunk);
  return {
    generations,
    alone,
    long: { tokens: tokens(long).length, finish_reason: long[long.length - 1].finish_reason },
    duplicate: sessionError(byStream.long),
    invalid: sessionError(byStream.bad),
    unknown_cancel: sessionError(byStream.nobody),
    empty_id: sessionError(byStream[""]),
  };
}

async function resume() {
  // A seeded stream dropped after 5 tokens, then resumed from there: equal to an unbroken run.
  const sampling = { temperature: 0.8, seed: 99 };
  const whole = tokens((await stream(client.Generate(request("resume from node", 30, { sampling })))).chunks);
  const req = request("resume from node", 30, { sampling, request_id: newId(), dedup: "DEDUP_POLICY_OFF" });
  const call = client.Generate(req);
  const received = await new Promise((resolve) => {
    const got = [];
    call.on("data", (c) => {
      got.push(...c.token_ids);
      if (got.length >= 5) {
        call.cancel(); // the stream drops; the generation goes on for the grace period
        resolve(got);
      }
    });
    call.on("error", () => {});
  });
  const rest = await stream(client.Resume({ request_id: req.request_id, offset: received.length }));
  return { whole, received, rest: tokens(rest.chunks), first_offset: rest.chunks[0].offset, error: rest.error };
}

async function cancel() {
  const req = request("cancel from node", LONG, { request_id: newId() });
  const call = client.Generate(req);
  const first = new Promise((resolve) => call.once("data", resolve));
  const whole = stream(call); // listens from the start: no chunk is missed
  await first;
  const cancelled = (await unary("Cancel", { request_id: req.request_id })).cancelled;
  const rest = await whole;
  const streamed = tokens(rest.chunks);
  const again = (await unary("Cancel", { request_id: req.request_id })).cancelled;
  const resumed = await stream(client.Resume({ request_id: req.request_id, offset: 0 }));
  const last = resumed.chunks[resumed.chunks.length - 1];
  return {
    cancelled,
    again,
    streamed: streamed.length,
    stream_finish: rest.chunks[rest.chunks.length - 1].finish_reason,
    resumed: tokens(resumed.chunks).length,
    resumed_equal: JSON.stringify(tokens(resumed.chunks)) === JSON.stringify(streamed),
    resumed_finish: last.finish_reason,
    resumed_completion_tokens: last.usage.completion_tokens,
  };
}

async function errors() {
  const caught = async (promise) => {
    try {
      await promise;
      return null;
    } catch (err) {
      return failure(err);
    }
  };
  const streamed = async (call) => (await stream(call)).error;
  const done = request("finished", 4, { request_id: newId() });
  await stream(client.Generate(done));
  const late = request("deadline", LONG, { request_id: newId() });
  const deadline = await streamed(client.Generate(late, { deadline: Date.now() + 1000 }));
  const afterDeadline = (await stream(client.Resume({ request_id: late.request_id }))).chunks.pop();
  const afterDeadlineTokens = afterDeadline.usage.completion_tokens;
  return {
    invalid: await streamed(client.Generate(request("bad", 4, { sampling: { temperature: -1 } }))),
    context: await streamed(client.Generate(request("too long", 5000))),
    unknown_resume: await streamed(client.Resume({ request_id: "no-such-request", offset: 0 })),
    unknown_cancel: await caught(unary("Cancel", { request_id: "no-such-request" })),
    beyond_end: await streamed(client.Resume({ request_id: done.request_id, offset: 5 })),
    key_mismatch: await streamed(
      client.Generate(request("keys", 3, { idempotency_key: "a" }), (() => {
        const md = new grpc.Metadata();
        md.set("x-idempotency-key", "b");
        return md;
      })()),
    ),
    deadline,
    after_deadline: { finish_reason: afterDeadline.finish_reason, tokens: afterDeadlineTokens },
  };
}

async function main() {
  const info = await unary("GetModelInfo", {});
  const out = { model_info: info, generate: await generate(), session: await session(), resume: await resume() };
  out.cancel = await cancel();
  out.errors = await errors();
  client.close();
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
