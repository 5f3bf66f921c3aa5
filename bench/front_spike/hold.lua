-- The hold of issue 20 item 2 for HAProxy 2.6: HAProxy itself has no "wait for a server"
-- (a request for a backend with no usable server is a 503 at once, 'timeout queue' only
-- applies to servers at their maxconn), so this action polls the server's state, which
-- qwen4090 would set over the runtime API ("set server vllm/engine state maint|ready").
--
--   http-request lua.hold <backend> <server> <hold_ms> <retry_after_s>
--
-- 'show front' (a runtime API command added here) prints the counters of item 7 that HAProxy
-- has no counter of its own for.

local counters = { held = 0, held_then_served = 0, held_then_503 = 0 }
local POLL_MS = 20

local function now_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec / 1000
end

local function serving(srv)
  local st = srv:get_stats().status
  return not (st:find("^MAINT") or st:find("^DOWN") or st:find("^DRAIN"))
end

core.register_action("hold", { "http-req" }, function(txn, backend, server, hold_ms, retry_after)
  local srv = core.backends[backend].servers[server]
  if serving(srv) then return end
  counters.held = counters.held + 1
  local deadline = now_ms() + tonumber(hold_ms)
  while not serving(srv) do
    if now_ms() >= deadline then
      counters.held_then_503 = counters.held_then_503 + 1
      txn:done(txn:reply({
        status = 503,
        headers = { ["content-type"] = { "application/json" },
                    ["retry-after"] = { retry_after } },
        body = '{"error":{"message":"the engine is restarting","type":"service_unavailable",'
               .. '"code":503}}' }))
      return
    end
    core.msleep(POLL_MS)
  end
  counters.held_then_served = counters.held_then_served + 1
end, 4)

core.register_cli({ "show", "front" }, "show front: held/served/503 counters of lua.hold",
  function(applet)
    local out = {}
    for k, v in pairs(counters) do out[#out + 1] = k .. "=" .. v end
    table.sort(out)
    applet:send(table.concat(out, " ") .. "\n")
  end)
