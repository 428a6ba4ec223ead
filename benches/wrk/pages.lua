-- wrk: pages of one video and its 20 comments (21 ids), each from a random
-- user of $WRK_TOKENS (one token a line). Used by benches/wrk/run.sh.
local tokens = {}
for line in io.lines(os.getenv("WRK_TOKENS")) do tokens[#tokens + 1] = line end
math.randomseed(7)
request = function()
  local v = math.random(200)
  local ids = "v" .. v
  for k = 1, 20 do ids = ids .. ",c" .. v .. "_" .. k end
  return wrk.format("GET", "/v1/votes/summary?target_ids=" .. ids,
    { ["Authorization"] = "Bearer " .. tokens[math.random(#tokens)] })
end
