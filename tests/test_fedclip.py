"""FedCLIP: AttAI's shape, count and attention; the losses against hand-computed values; what a
client sends; the baselines' trainable parts; leave-one-domain-out."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_CLIP, tiny_run
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedadapt.adapters import build_model
from fedadapt.adapters.fedclip import AttAI, FedClipConfig, PromptHead, contrastive_loss
from fedadapt.backbones import build_backbone
from fedadapt.backbones.clip import class_text
from fedadapt.clients.app import make_client_app
from fedadapt.config import BackboneConfig, ConfigError, DatasetConfig, validate
from fedadapt.experiment import prepare_run
from fedadapt.federation.simulation.inprocess import run_in_process
from fedadapt.federation.wire import records


@pytest.mark.parametrize("dim", [16, 512])
def test_attai_shape_and_parameter_count(dim):
    att = AttAI(dim)
    assert sum(p.numel() for p in att.parameters()) == 2 * (dim * dim + dim)
    assert att(torch.randn(3, dim)).shape == (3, dim)


@pytest.mark.slow
def test_attai_on_vit_b32_has_525312_parameters_from_the_architecture():
    """The acceptance command's count: ViT-B/32 with random weights (no download)."""
    from fedadapt.counts import inspect_run
    from fedadapt.entry import compose_config, to_run_config

    run = to_run_config(compose_config(["method=fedclip", "backbone=clip_vit_b32",
                                        "dataset=pacs"]))
    counts = inspect_run(run)
    assert counts["embed_dim"] == 512
    assert counts["trainable_params"] == counts["communicated_params"] == 525_312


def test_attention_sums_to_one_over_features():
    att = AttAI(16)
    a = att.attention(torch.randn(5, 16) * 10)
    assert (a >= 0).all()
    torch.testing.assert_close(a.sum(-1), torch.ones(5))


def _head(text, scale, **kw):
    return PromptHead(text.shape[1], text.shape[0], image_adapter=False, text_adapter=False,
                      text_features=text, logit_scale=scale, **kw)


def test_losses_match_hand_computed_values():
    # two unit image features, two classes' unit text features, scale 2
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    text = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    y = torch.tensor([0, 1])
    head = _head(text, 2.0)
    # cosine logits s * I T^T = 2 * [[1, 0.6], [0, 0.8]]
    logits = head(image)
    torch.testing.assert_close(logits, torch.tensor([[2.0, 1.2], [0.0, 1.6]]))
    ce = 0.5 * (-(2.0 - math.log(math.exp(2.0) + math.exp(1.2)))
                - (1.6 - math.log(math.exp(0.0) + math.exp(1.6))))
    assert float(head.loss(image, y, "ce")) == pytest.approx(ce, abs=1e-6)
    # contrastive: rows = image->text (here T[y] = T, so the same matrix), columns = text->image
    # image->text: row 0 target 0 [2, 1.2]; row 1 target 1 [0, 1.6]
    # text->image: column 0 target 0 [2, 0]; column 1 target 1 [1.2, 1.6]
    i2t = ce
    t2i = 0.5 * (-(2.0 - math.log(math.exp(2.0) + math.exp(0.0)))
                 - (1.6 - math.log(math.exp(1.2) + math.exp(1.6))))
    assert float(head.loss(image, y, "contrastive")) == pytest.approx(0.5 * (i2t + t2i), abs=1e-6)
    # a batch whose two samples share a class: the text side is T[y], repeated
    y_same = torch.tensor([1, 1])
    direct = contrastive_loss(image, text[y_same], torch.tensor(2.0))
    assert float(head.loss(image, y_same, "contrastive")) == pytest.approx(float(direct))


def test_feature_is_scaled_by_attention_then_normalised():
    text = F.normalize(torch.randn(3, 8), dim=-1)
    head = PromptHead(8, 3, image_adapter=True, text_adapter=False, text_features=text,
                      logit_scale=5.0)
    f = torch.randn(4, 8)
    expected = F.normalize(head.image_adapter.attention(f) * f, dim=-1)
    torch.testing.assert_close(head.image_features(f), expected)
    torch.testing.assert_close(head(f), 5.0 * expected @ text.t())


def test_methods_train_what_the_paper_says():
    backbone = build_backbone(TINY_CLIP)
    ct = class_text(backbone, ["dog", "elephant", "giraffe"], "a picture of a {}")
    assert ct.prompts[0] == "a picture of a dog" and ct.features.shape == (3, 16)

    def trainable(**kw):
        cfg = FedClipConfig(**kw)
        return build_model(cfg, backbone, 3, class_text=ct).trainable_names()

    assert all(n.startswith("head.image_adapter.") for n in trainable())
    assert {n.split(".")[1] for n in trainable(text_adapter=True)} == {"image_adapter",
                                                                        "text_adapter"}
    whole = trainable(image_adapter=False, train_backbone=True, use_cache=False)
    assert any(".visual." in n for n in whole) and any("transformer" in n and ".visual." not in n
                                                       for n in whole)
    assert "backbone.model.logit_scale" in whole
    with pytest.raises(ConfigError, match="method.classifier=prompts"):
        build_model(FedClipConfig(), build_backbone(BackboneConfig(
            name="s", family="small_cnn", image_size=16, arch={"width": 4})), 3, class_text=None)
    with pytest.raises(ConfigError, match="method.loss"):
        build_model(FedClipConfig(classifier="linear"), backbone, 3, class_text=ct)


def test_whole_clip_baseline_learns_through_the_text_tower():
    """fedavg_clip: the text tower is part of the forward pass, so its weights get gradients."""
    backbone = build_backbone(TINY_CLIP)
    ct = class_text(backbone, ["dog", "cat"], "a picture of a {}")
    model = build_model(FedClipConfig(image_adapter=False, train_backbone=True, use_cache=False),
                        backbone, 2, class_text=ct)
    model.train()
    loss = model.training_loss(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 0, 1]))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads["backbone.model.token_embedding.weight"] is not None
    assert grads["backbone.model.visual.conv1.weight"] is not None


def test_client_sends_only_the_adapter(cache_dir, flower_task):
    cfg = tiny_run(cache_dir, FedClipConfig(weighting="uniform"), backbone=TINY_CLIP)
    prep = prepare_run(validate(cfg), quiet=True)
    app = make_client_app(lambda ctx: prep.spec)
    sent = prep.model.tensors(prep.model.communicated_names())
    msg = Message(RecordDict({"arrays": ArrayRecord(sent), "config": ConfigRecord(
        {"server-round": 1, "lr": 0.01}), records.GRID: ConfigRecord({"clients": [0]})}),
                  dst_node_id=1, message_type=MessageType.TRAIN)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                  state=RecordDict(), run_config={})
    reply = records.view(app(msg, ctx).content, 0)
    got = reply.array_records["arrays"].to_torch_state_dict()
    assert sorted(got) == ["head.image_adapter.net.0.bias", "head.image_adapter.net.0.weight",
                           "head.image_adapter.net.2.bias", "head.image_adapter.net.2.weight"]
    assert any(not torch.equal(got[k], sent[k]) for k in got)  # it trained
    assert reply.metric_records["metrics"]["unit-weight"] == 1.0
    assert "head.text_features" not in got  # the frozen prompts' features never travel


def test_prompts_need_a_placeholder(cache_dir):
    cfg = tiny_run(cache_dir, FedClipConfig(prompt="a picture"), backbone=TINY_CLIP,
                   dataset=DatasetConfig(name="digits", max_samples=300))
    with pytest.raises(ConfigError, match="method.prompt"):
        prepare_run(validate(cfg), quiet=True)


PACS_DOMAINS = ["art_painting", "cartoon", "photo", "sketch"]
PACS_CLASSES = ["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"]


@pytest.fixture(scope="module")
def pacs_like(tmp_path_factory) -> str:
    """A PACS-shaped data set (4 domains x 7 classes, 12 images each), generated: each domain
    tints the image, each class draws a bar at its own row."""
    import numpy as np

    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value

    rng = np.random.default_rng(0)
    images, labels, domains = [], [], []
    for d, domain in enumerate(PACS_DOMAINS):
        for c in range(len(PACS_CLASSES)):
            for _ in range(12):
                img = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
                img[2 * c:2 * c + 2, :, d % 3] = 255
                images.append(img)
                labels.append(c)
                domains.append(domain)
    ds = Dataset.from_dict({"image": images, "label": labels, "domain": domains},
                           features=Features({"image": Image(),
                                              "label": ClassLabel(names=PACS_CLASSES),
                                              "domain": Value("string")}))
    path = tmp_path_factory.mktemp("pacs_like") / "pacs"
    DatasetDict(train=ds).save_to_disk(str(path))
    return str(path)


@pytest.mark.slow
def test_pacs_shaped_experiment_end_to_end(pacs_like, cache_dir, tmp_path):
    """Acceptance: offline, a tiny random CLIP, leave-one-domain-out; the three tables."""
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.results.domain_tables import domain_tables

    summaries = []
    for holdout in ("sketch", "photo"):
        cfg = compose_config(["experiment=fedclip_pacs", f"dataset.path={pacs_like}",
                              f"partition.holdout={holdout}", "rounds=3", "train.lr=0.01",
                              f"cache_dir={cache_dir}"])
        run = to_run_config(cfg)
        run.backbone = TINY_CLIP
        prep = prepare_run(run, quiet=True)
        # leave-one-domain-out: nothing the clients hold comes from the held-out domain
        held = set(prep.partition.unseen.tolist())
        assert prep.partition.unseen_name == holdout and holdout not in prep.partition.names
        for split in prep.spec.clients:
            assert held.isdisjoint(split.train) and held.isdisjoint(split.val)
            assert held.isdisjoint(split.test)
        summary = run_experiment(run, tmp_path / holdout, config_yaml=f"{holdout}\n",
                                 prepared=prep, execute=run_in_process)
        dom = summary["domains"]
        assert dom["holdout"] == holdout and len(dom["clients"]) == 3
        assert summary["selection"] == "best_val" and summary["selected"]["val_acc"] is not None
        accs = [dom["generalization"], *dom["personalization"].values()]
        assert dom["overall"] == pytest.approx(sum(accs) / 4)
        assert summary["params"]["communicated_params"] == 2 * (16 * 16 + 16)
        summaries.append(summary)
    md = domain_tables(summaries)
    for title in ("Generalization (Table 1)", "Personalization (Table 2)", "Overall"):
        assert title in md



def test_alexnet_backbone_is_torchvisions_up_to_the_penultimate_layer():
    backbone = build_backbone(BackboneConfig(name="alexnet", family="alexnet", image_size=64))
    assert backbone.embed_dim == 4096
    assert backbone(torch.randn(2, 3, 64, 64)).shape == (2, 4096)
    from torchvision.models import alexnet

    last_layer = 4096 * 1000 + 1000  # Linear(4096, 1000), replaced by the method's head
    assert backbone.num_params() == sum(p.numel() for p in alexnet().parameters()) - last_layer
    with pytest.raises(Exception, match="backbone.weights"):
        build_backbone(BackboneConfig(name="alexnet", family="alexnet", weights="NOPE"))


def test_compare_entry_can_name_another_backbone():
    from fedadapt.entry import compose_config, job_configs

    overrides = ["experiment=fedclip_pacs"]
    cfg = compose_config(overrides)
    from hydra import initialize_config_module

    from fedadapt.paths import CONF_MODULE

    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        jobs = {name: run for name, run, _ in job_configs(cfg, overrides)}
    assert jobs["fedclip"].backbone.name == "clip_vit_b32"
    assert jobs["fedavg_alexnet"].backbone.name == "alexnet"
    # each baseline pins the strategy it is named for, whatever strategy= the job names
    assert jobs["fedclip"].strategy.name == "fedavg"
    assert jobs["fedavg_alexnet"].strategy.name == "fedavg"
    assert jobs["fedprox_alexnet"].strategy.name == "fedprox"
    assert jobs["fedprox_clip"].strategy.proximal_mu == 1e-3
    adam_overrides = overrides + ["strategy=fedadam"]
    adam_cfg = compose_config(adam_overrides)
    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        adam = {name: run for name, run, _ in job_configs(adam_cfg, adam_overrides)}
    assert adam["fedclip"].strategy.name == "fedadam"
    assert adam["fedprox_clip"].strategy.name == "fedprox"


def test_each_baseline_trains_with_its_own_optimiser():
    """One compare job, each row's optimiser from its own paper / authors' code: the adapter
    with the authors' Adam (weight decay 0.2), whole CLIP with Adam and no decay, AlexNet with
    PersonalizedFL's plain SGD 1e-2; the run directory's config shows the merged ``train``."""
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, job_configs, to_run_config
    from fedadapt.paths import CONF_MODULE

    overrides = ["experiment=fedclip_pacs"]
    cfg = compose_config(overrides)
    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        jobs = {name: (run, yaml) for name, run, yaml in job_configs(cfg, overrides)}
    opt = {name: (r.train.optimizer, r.train.lr, r.train.momentum, r.train.weight_decay)
           for name, (r, _) in jobs.items()}
    assert opt["fedclip"] == ("adam", 5e-5, 0.9, 0.2)
    assert opt["fedavg_clip"][::3] == ("adam", 0.0) == opt["fedprox_clip"][::3]
    assert jobs["fedavg_clip"][0].train.betas == [0.9, 0.98]
    assert opt["fedavg_alexnet"] == ("sgd", 0.01, 0.0, 0.0) == opt["fedprox_alexnet"]
    saved = OmegaConf.create(jobs["fedavg_alexnet"][1])
    assert saved.train.optimizer == "sgd" and saved.method.train.lr == 0.01
    # a command-line override of the method's own setting wins; a foreign key is named
    run = to_run_config(compose_config(["experiment=fedclip_pacs", "method=fedavg_alexnet",
                                        "method.train.lr=0.1"]))
    assert run.train.lr == 0.1 and run.train.optimizer == "sgd"
    with pytest.raises(ConfigError, match="method.train"):
        to_run_config(compose_config(["experiment=fedclip_pacs", "method=fedavg_alexnet",
                                      "+method.train.nesterov=true"]))


def test_local_finetuning_after_fl_without_exits(cache_dir, tmp_path):
    """Sec. 4.4 (Figure 3c): FL, then each client fine-tunes on its clean data; before / after."""
    from fedadapt.adapters.heads import LinearHeadConfig
    from fedadapt.config import SettingConfig
    from fedadapt.experiment import run_experiment

    cfg = validate(tiny_run(cache_dir, LinearHeadConfig(),
                            setting=SettingConfig(name="personalization", severities=[0],
                                                  epochs=2)))
    summary = run_experiment(cfg, tmp_path / "ft", config_yaml="ft\n", execute=run_in_process)
    pers = summary["personalization"]
    assert pers["clients"] == 3 and pers["per_tier"] == {}
    assert pers["after"] is not None and pers["gain"] == pytest.approx(pers["after"]
                                                                       - pers["before"])
    corrupted = validate(tiny_run(cache_dir, LinearHeadConfig(),
                                  setting=SettingConfig(name="personalization")))
    with pytest.raises(ConfigError, match="setting.severities"):
        prepare_run(corrupted, quiet=True)
