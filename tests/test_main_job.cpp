// The main job as a new user runs it (issue 23): fsdp-train ends with a summary, keeps its
// checkpoint and the whole model in a run folder, prints the one-line commands that resume it
// and load it in Python, and a text sample the trained GPT writes. The printed commands are run
// as printed.
#include <sys/stat.h>

#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "dist_test_util.h"

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The rest of the line that starts with `prefix` ("" when there is none).
std::string after(const std::string& output, const std::string& prefix) {
  for (const std::string& line : lines_of(output)) {
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
  }
  return "";
}

// Everything after the "== sample:" line: the text (the sample is the run's last output).
std::string sample_text(const std::string& output) {
  const size_t at = output.find("== sample:");
  if (at == std::string::npos) return "";
  const size_t text = output.find('\n', at);
  return text == std::string::npos ? "" : output.substr(text + 1);
}

// Runs a printed command line in `dir` as the user would paste it into a shell.
fsdp_test::Run paste(const std::string& dir, const std::string& command) {
  const std::string script = dir + "/pasted.sh";
  std::ofstream(script) << "cd " << dir << " && " << command << "\n";
  return fsdp_test::sh("bash " + script, 300);
}

std::vector<double> losses(const std::string& jsonl) {
  std::vector<double> out;
  for (const auto& j : fsdp_test::read_jsonl(jsonl)) {
    if (j["rank"] != 0) continue;
    const size_t step = j["step"].get<size_t>();
    if (out.size() <= step) out.resize(step + 1, -1.0);
    out[step] = j["loss"].get<double>();
  }
  return out;
}

const std::string kPrompt = "This program is ";  // fsdp-train's default --prompt

}  // namespace

TEST(MainJob, MainJobEndsWithSomethingToKeep) {
  const std::string dir = fsdp_test::temp_prefix("main-job-end");
  ASSERT_EQ(fsdp_test::sh("rm -rf " + dir + " && mkdir -p " + dir).exit_code, 0);
  const std::string flags = " --nproc-per-node 2 --model tiny --global-batch-size 8 --log-every 100 --sample-tokens 40";
  // The user's run: defaults for where things go (runs/ under the working directory).
  const auto first = fsdp_test::sh("cd " + dir + " && " + fsdp_test::bin_dir() + "/fsdp-train" + flags +
                                   " --steps 6 --metrics-jsonl " + dir + "/run.jsonl");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string& out = first.output;

  // The summary.
  EXPECT_NE(out.find("== summary: GPT 'tiny'"), std::string::npos) << out;
  EXPECT_EQ(after(out, "   steps      "), "6 (step 0 to 5)") << out;
  EXPECT_NE(after(out, "   wall time  ").find(" s (median step "), std::string::npos) << out;
  EXPECT_NE(after(out, "   throughput ").find(" tok/s over the run"), std::string::npos) << out;
  const std::vector<double> trained = losses(dir + "/run.jsonl");
  ASSERT_EQ(trained.size(), 6u);
  char loss_line[128];
  std::snprintf(loss_line, sizeof loss_line, "%.4f at step 0 -> %.4f at step 5", trained[0], trained[5]);
  EXPECT_EQ(after(out, "   loss       "), loss_line) << out;
  EXPECT_NE(after(out, "   held-out   loss "), "") << out;

  // The saved files, in a run folder named after the model.
  const std::string folder = after(out, "== saved in ");
  ASSERT_TRUE(std::regex_match(folder, std::regex("runs/tiny-[0-9]{8}-[0-9]{6}(-[0-9]+)?/"))) << out;
  EXPECT_EQ(after(out, "   checkpoint ").rfind(folder + "checkpoints/step-00000006 (sharded, ", 0), 0u) << out;
  EXPECT_EQ(after(out, "   model      ").rfind(folder + "model.safetensors (", 0), 0u) << out;
  struct stat st {};
  EXPECT_EQ(::stat((dir + "/" + folder + "model.safetensors").c_str(), &st), 0);
  const auto summary = fsdp_test::read_json(dir + "/" + folder + "summary.json");
  EXPECT_EQ(summary["steps"], 6);
  EXPECT_EQ(summary["last_loss"].get<double>(), trained[5]);

  // The sample comes last: the prompt and 40 tokens after it.
  const std::string text = sample_text(out);
  EXPECT_NE(out.find("== sample: 40 tokens after \"" + kPrompt + "\""), std::string::npos) << out;
  EXPECT_EQ(text.rfind(kPrompt, 0), 0u) << out;
  EXPECT_EQ(text.size(), kPrompt.size() + 40 + 1) << out;  // and the newline that ends it

  // "in Python:" loads the safetensors file with the project's Python: every parameter is in it.
  const std::string python = after(out, "   in Python: ");
  ASSERT_NE(python, "") << out;
  const auto loaded = paste(dir, python);
  ASSERT_EQ(loaded.exit_code, 0) << python << "\n" << loaded.output;
  std::smatch header;
  ASSERT_TRUE(std::regex_search(out, header, std::regex("GPT 'tiny' ([0-9]+) parameters"))) << out;
  EXPECT_NE(loaded.output.find(" tensors, " + header[1].str() + " parameters"), std::string::npos)
      << loaded.output << " (fsdp-train: " << header[1] << " parameters)";

  // "resume:" continues the run to twice its steps, from its checkpoint, bit for bit: the losses of
  // one uninterrupted run of 12 steps, and the same sample from the same trained model, written
  // there through the sharded forward instead of summon_full_params.
  const std::string resume = after(out, "   resume:    ");
  ASSERT_NE(resume.find(" --resume " + folder + "checkpoints --steps 12"), std::string::npos) << out;
  const auto resumed = paste(dir, resume);
  ASSERT_EQ(resumed.exit_code, 0) << resume << "\n" << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + folder + "checkpoints/step-00000006 at step 6"), std::string::npos)
      << resumed.output;
  const auto whole = fsdp_test::sh("cd " + dir + " && " + fsdp_test::bin_dir() + "/fsdp-train" + flags +
                                   " --steps 12 --sample-via sharded --run-dir whole --metrics-jsonl " + dir + "/whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::vector<double> continued = losses(dir + "/run.jsonl"), uninterrupted = losses(dir + "/whole.jsonl");
  ASSERT_EQ(continued.size(), 12u);
  EXPECT_EQ(continued, uninterrupted);
  EXPECT_NE(whole.output.find("through the sharded forward"), std::string::npos) << whole.output;
  EXPECT_NE(resumed.output.find("through summon_full_params"), std::string::npos) << resumed.output;
  EXPECT_EQ(sample_text(resumed.output), sample_text(whole.output));
  EXPECT_NE(sample_text(resumed.output), text);  // 12 steps of training write other text than 6
  fsdp_test::sh("rm -rf " + dir);
}

TEST(MainJob, RunDirNoneKeepsNothingAndTwoRunsNeverShareAFolder) {
  const std::string dir = fsdp_test::temp_prefix("main-job-folders");
  ASSERT_EQ(fsdp_test::sh("rm -rf " + dir + " && mkdir -p " + dir).exit_code, 0);
  const std::string train = "cd " + dir + " && " + fsdp_test::bin_dir() + "/fsdp-train --model tiny --steps 1 "
                            "--global-batch-size 4 --sample-tokens 0";
  const auto none = fsdp_test::sh(train + " --run-dir none");
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_EQ(none.output.find("== saved in"), std::string::npos) << none.output;
  EXPECT_EQ(fsdp_test::sh("test -e " + dir + "/runs").exit_code, 1);
  // Two runs that start in the same second with the same model get two folders.
  const auto both = fsdp_test::sh("(" + train + " > " + dir + "/a.log 2>&1 & " + train + " > " + dir + "/b.log 2>&1; wait) && "
                                  "cat " + dir + "/a.log " + dir + "/b.log");
  ASSERT_EQ(both.exit_code, 0) << both.output;
  std::vector<std::string> folders;
  for (const std::string& line : lines_of(both.output)) {
    if (line.rfind("== saved in ", 0) == 0) folders.push_back(line.substr(12));
  }
  ASSERT_EQ(folders.size(), 2u) << both.output;
  EXPECT_NE(folders[0], folders[1]);
  fsdp_test::sh("rm -rf " + dir);
}

// The README's DHEN command, at test size (issue 35): the DHEN-like model's embedding rows live
// outside fsdp, each rank its own (Options::row_sharded_parameters), and the run still ends with
// its run folder: the checkpoint, the whole model (every row of the table: the Python one-liner
// counts the parameters the header states) and the summary. Its printed resume command continues
// it bit for bit, and at another --nproc-per-node within fp32 rounding.
TEST(MainJob, DHENEndsWithItsRunFolderAndResumesAtAnotherWorldSize) {
  const std::string dir = fsdp_test::temp_prefix("main-job-dhen");
  ASSERT_EQ(fsdp_test::sh("rm -rf " + dir + " && mkdir -p " + dir).exit_code, 0);
  const std::string flags = " --model dhen-tiny --log-every 100";
  const auto first = fsdp_test::sh("cd " + dir + " && " + fsdp_test::bin_dir() + "/fsdp-train --nproc-per-node 2" + flags +
                                   " --steps 4 --metrics-jsonl " + dir + "/run.jsonl");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string& out = first.output;
  const std::string folder = after(out, "== saved in ");
  ASSERT_TRUE(std::regex_match(folder, std::regex("runs/dhen-tiny-[0-9]{8}-[0-9]{6}(-[0-9]+)?/"))) << out;
  EXPECT_EQ(after(out, "   checkpoint ").rfind(folder + "checkpoints/step-00000004 (sharded, ", 0), 0u) << out;
  EXPECT_EQ(after(out, "   model      ").rfind(folder + "model.safetensors (", 0), 0u) << out;
  EXPECT_EQ(fsdp_test::read_json(dir + "/" + folder + "summary.json")["steps"], 4);
  const auto loaded = paste(dir, after(out, "   in Python: "));
  ASSERT_EQ(loaded.exit_code, 0) << loaded.output;
  std::smatch header;
  ASSERT_TRUE(std::regex_search(out, header, std::regex("DHEN-like 'dhen-tiny' ([0-9]+) parameters"))) << out;
  EXPECT_NE(loaded.output.find(" tensors, " + header[1].str() + " parameters"), std::string::npos)
      << loaded.output << " (fsdp-train: " << header[1] << " parameters)";

  const std::string resume = after(out, "   resume:    ");
  ASSERT_NE(resume.find(" --nproc-per-node 2 "), std::string::npos) << out;
  ASSERT_NE(resume.find(" --resume " + folder + "checkpoints --steps 8"), std::string::npos) << out;
  const auto whole = fsdp_test::sh("cd " + dir + " && " + fsdp_test::bin_dir() + "/fsdp-train --nproc-per-node 2" + flags +
                                   " --steps 8 --run-dir none --metrics-jsonl " + dir + "/whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::vector<double> uninterrupted = losses(dir + "/whole.jsonl");
  ASSERT_EQ(uninterrupted.size(), 8u);
  for (const int nproc : {2, 1}) {
    std::string command = resume;
    command.replace(command.find(" --nproc-per-node 2 "), 20, " --nproc-per-node " + std::to_string(nproc) + " ");
    const std::string metrics = dir + "/resumed-" + std::to_string(nproc) + ".jsonl";
    command.replace(command.find(dir + "/run.jsonl"), (dir + "/run.jsonl").size(), metrics);
    const auto resumed = paste(dir, command);
    ASSERT_EQ(resumed.exit_code, 0) << command << "\n" << resumed.output;
    EXPECT_NE(resumed.output.find("resumed from " + folder + "checkpoints/step-00000004 at step 4"), std::string::npos)
        << resumed.output;
    const std::vector<double> continued = losses(metrics);
    ASSERT_EQ(continued.size(), 8u) << resumed.output;
    for (size_t s = 4; s < 8; ++s) {
      if (nproc == 2) {
        EXPECT_EQ(continued[s], uninterrupted[s]) << "step " << s << ", resumed at the saving world size";
      } else {
        EXPECT_NEAR(continued[s], uninterrupted[s], 1e-5 * uninterrupted[s]) << "step " << s << " at W = " << nproc;
      }
    }
  }
  fsdp_test::sh("rm -rf " + dir);
}

// Issue 39: scripts/train, the README's main job, runs the schedule chosen for it (360 steps,
// 30 of warmup, a cosine decay from 2e-3 to 2e-4); a flag the user gives replaces its part (a
// step count only the step count; any learning-rate flag the whole schedule).
TEST(MainJob, ScriptsTrainRunsItsScheduleAndTheUsersFlagsReplaceIt) {
  const std::string jsonl = fsdp_test::temp_prefix("main-job-schedule") + ".jsonl";
  auto lrs = [&](const std::string& flags) {
    std::remove(jsonl.c_str());
    const auto run = fsdp_test::sh("bash " FSDP_SOURCE_DIR "/scripts/train --model tiny --log-every 1000 --run-dir none "
                                   "--sample-tokens 0 --metrics-jsonl " + jsonl + " " + flags, 300);
    EXPECT_EQ(run.exit_code, 0) << flags << "\n" << run.output;
    std::map<int, double> lr;
    std::ifstream in(jsonl);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("event") && j.value("rank", -1) == 0) lr[j["step"].get<int>()] = j["lr"].get<double>();
    }
    return lr;
  };
  auto chosen = lrs("--steps 40");  // the step count replaced, the schedule kept
  ASSERT_EQ(chosen.size(), 40u);
  EXPECT_DOUBLE_EQ(chosen[0], 2e-3 / 30);
  EXPECT_DOUBLE_EQ(chosen[29], 2e-3);
  EXPECT_DOUBLE_EQ(chosen[39], 2e-4);
  auto constant = lrs("--steps 3 --lr 1e-3");  // a rate given: no schedule added
  ASSERT_EQ(constant.size(), 3u);
  for (const auto& [step, lr] : constant) EXPECT_DOUBLE_EQ(lr, 1e-3) << "step " << step;
  std::remove(jsonl.c_str());
}
