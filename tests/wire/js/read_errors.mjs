// What the Vercel AI SDK reports for calls through the gateway, printed as one JSON line (a list,
// one outcome per call, in order).
//
//   node read_errors.mjs BASE_URL '[{"wire": ..., "model": ..., "stream": true|false}, ...]'
//
// wire: anthropic (@ai-sdk/anthropic), chat (@ai-sdk/openai's Chat Completions model) or
// responses (its Responses model). Each call is made as an app would make it, with `ai`'s
// streamText or generateText and no retries; every error the SDK surfaces is reported with
// the fields it carries (a stream's error parts, or the error a call throws). The calls run
// at once: one process, since loading the SDK is most of a call's time.
import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText } from "ai";

const [baseURL, calls] = process.argv.slice(2);

function model(wire, modelId) {
  const settings = { baseURL: `${baseURL}/v1`, apiKey: "caller-key" };
  if (wire === "anthropic") return createAnthropic(settings)(modelId);
  const openai = createOpenAI(settings);
  if (wire === "chat") return openai.chat(modelId);
  if (wire === "responses") return openai.responses(modelId);
  throw new Error(`unknown wire ${wire}`);
}

// The fields a caller reads off an error, whatever kind it is (an Error or a plain object).
function described(error) {
  if (error == null || typeof error !== "object") return { message: String(error) };
  const out = {};
  for (const key of ["name", "message", "type", "code", "statusCode", "isRetryable"]) {
    if (error[key] !== undefined) out[key] = error[key];
  }
  if (error.data !== undefined) out.data = error.data;
  return out;
}

async function run({ wire, model: modelId, stream }) {
  const request = { model: model(wire, modelId), prompt: "hi", maxOutputTokens: 20, maxRetries: 0 };
  const errors = [];
  let text = "";
  if (stream) {
    const result = streamText({ ...request, onError: () => {} });
    for await (const part of result.fullStream) {
      if (part.type === "text-delta") text += part.text;
      else if (part.type === "error") errors.push(described(part.error));
    }
  } else {
    try {
      text = (await generateText(request)).text;
    } catch (error) {
      errors.push(described(error));
    }
  }
  return { text, errors };
}

function settled(call) {
  return run(call).catch((error) => ({ text: "", errors: [described(error)], thrown: true }));
}

const outcomes = await Promise.all(JSON.parse(calls).map(settled));
process.stdout.write(JSON.stringify(outcomes) + "\n");
