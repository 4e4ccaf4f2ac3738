"""Planning image-text conversations: the cost per conversation of counting its tokens from the image headers
(`pack_dataset(..., processor=...)`'s planner), against blank stand-in images run through the processor (the planner's
fallback) and against what TRL's vision collator does to know a length (decode and process every image).

    python benchmarks/image_text_planning.py                  # 200 conversations, 1-2 photos of 480 to 2048 px
    python benchmarks/image_text_planning.py --conversations 20   # smoke run

Photos are matplotlib's sample photos resized and saved as JPEG files on disk (real pixels, as a dataset of paths
holds them); the processor is the demo's Qwen2.5-VL one (images capped at 64 tokens, as in the recipe). The three
counts must agree; the table gives wall ms per conversation.
"""

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SIZES = [(640, 480), (1024, 768), (2048, 1536), (480, 800), (1280, 720)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--output", default=os.path.join(RESULTS, "image_text_planning.md"))
    args = parser.parse_args()
    import matplotlib
    from PIL import Image

    from llm_packing.core.image_text import open_image, structured_messages
    from llm_packing.data.image_text import ConversationPlanner
    from llm_packing.demo.photos import load_demo_processor

    processor = load_demo_processor()
    sample = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data")
    photos = [Image.open(os.path.join(sample, name)).convert("RGB")
              for name in ("grace_hopper.jpg", "logo2.png", "Minduka_Present_Blue_Pack.png")]
    directory = tempfile.mkdtemp()
    rows = []
    for i in range(args.conversations):
        paths = []
        for k in range(1 + i % 2):
            path = os.path.join(directory, f"{i}-{k}.jpg")
            photos[(i + k) % 3].resize(SIZES[(i + k) % len(SIZES)]).save(path, quality=90)
            paths.append(path)
        rows.append(([{"role": "user", "content": f"What is in picture {i}?"},
                      {"role": "assistant", "content": "A photo of something, described at some length."}], paths))
    megabytes = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)) / 2**20
    header = ConversationPlanner(processor)
    stand_ins = ConversationPlanner(processor)
    stand_ins.rule = None  # force the fallback: blank images of each size through the processor

    def decoded(messages, paths, where):
        images = [open_image(path, where) for path in paths]
        output = processor.apply_chat_template(structured_messages(messages, images, where), tokenize=True,
                                               return_dict=True, processor_kwargs={"add_special_tokens": False})
        return len(output["input_ids"][0]), None

    methods = {"header (llm_packing planner)": lambda m, p, w: header.plan(m, p, w),
               "blank stand-ins through the processor": lambda m, p, w: stand_ins.plan(m, p, w),
               "decode + process (TRL's vision collator)": decoded}
    results, counts = {}, {}
    for name, method in methods.items():
        start = time.perf_counter()
        counts[name] = [method(messages, paths, f"row {i}")[0] for i, (messages, paths) in enumerate(rows)]
        results[name] = (time.perf_counter() - start) / len(rows) * 1e3
    reference = counts["decode + process (TRL's vision collator)"]
    assert all(found == reference for found in counts.values()), "the counts differ"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"# Planning image-text token counts ({datetime.date.today()})", "",
             f"{platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} at the end; {len(rows)} "
             f"conversations, {sum(len(p) for _, p in rows)} JPEG photos on disk ({megabytes:.1f} MiB, "
             f"{SIZES[0][0]} x {SIZES[0][1]} to 2048 x 1536); demo Qwen2.5-VL processor. All three methods give the "
             "same token count for every conversation.", "",
             "| method | ms / conversation |", "|---|---|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in results.items()]
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
